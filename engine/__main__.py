"""`python -m engine --model DIR --prompt TEXT`: generate from the command line with the offline API."""

from __future__ import annotations

import argparse
import time

from engine import LLM, SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m engine", description="Generate text with the offline API."
    )
    parser.add_argument("--model", required=True, help="a Hugging Face model folder")
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)
    llm = LLM(args.model, device=args.device, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    start = time.perf_counter()
    outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(f"{prompt!r} -> {out.text!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f} s on {llm.engine.device} ({total / elapsed:.1f} tok/s)")


if __name__ == "__main__":
    main()
