"""The offline API: `LLM(model_dir, **options).generate(prompts, sampling_params)`, as in vLLM.

It validates every prompt before scheduling any (bad input raises, nothing runs), then steps the
engine until all requests finish and returns their outputs in input order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC

from engine.config import EngineArgs
from engine.engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str, **options) -> None:
        unknown = sorted(set(options) - set(EngineArgs.field_names()))
        if unknown:
            raise TypeError(
                f"unknown option(s) {unknown}; known: {sorted(set(EngineArgs.field_names()) - {'model'})}"
            )
        self.engine = LLMEngine(EngineArgs(model=str(model), **options))
        self.tokenizer = self.engine.tokenizer
        self._batches = itertools.count()  # request ids unique across generate calls

    def generate(
        self,
        prompts: Prompt | SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompt_list)} prompts")
        for prompt, params in zip(prompt_list, params_list, strict=True):
            self.engine.validate(prompt, params)
        base = f"offline-{next(self._batches)}-"
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            self.engine.add_request(f"{base}{i}", prompt, params)
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
        return [results[f"{base}{i}"] for i in range(len(prompt_list))]


def _as_prompt_list(prompts: Prompt | SequenceABC[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) for p in items):
        return [[int(p) for p in items]]  # type: ignore[arg-type]  # one prompt of token ids
    return items  # type: ignore[return-value]
