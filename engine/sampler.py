"""Token selection from the last hidden state's logits: greedy, temperature, top-k, top-p, seeds.

Greedy rows take the argmax in one batched op; the tokens stay on the device (the runner copies them
back without blocking, so the host can work while the GPU finishes the step). Random rows are scaled, filtered by top-k then top-p,
and drawn with each sequence's own torch.Generator, so a seeded request gets the same tokens whatever
else shares its batch.
"""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask with -inf what top-k and top-p remove. logits [rows, vocab]; top_k [rows] (<=0: off); top_p [rows].

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p; the most
    likely token always stays.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the tokens ranked above each one
    remove |= mass_before >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """logits [rows, vocab] float32 -> [rows] int64 token ids, on logits' device (no host sync)."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        rows = logits[index]
        temperature = torch.tensor([params[i].temperature for i in random_rows], device=logits.device)
        temperature = temperature.clamp(min=torch.finfo(temperature.dtype).tiny)  # 1e-300 is 0 in float32
        vocab = logits.shape[-1]
        # Past the vocabulary top-k keeps everything; clamped so that any integer fits an int64 tensor.
        top_k = torch.tensor([min(params[i].top_k, vocab) for i in random_rows], device=logits.device)
        top_p = torch.tensor([params[i].top_p for i in random_rows], device=logits.device, dtype=rows.dtype)
        # Shifted so each row's largest logit is 0 (softmax does not change): a tiny temperature then
        # sends the others to -inf rather than overflowing to inf - inf = NaN.
        rows = rows - rows.amax(dim=-1, keepdim=True)
        rows = apply_top_k_top_p(rows / temperature[:, None], top_k, top_p)
        probs = rows.softmax(dim=-1)
        for j, i in enumerate(random_rows):
            tokens[i] = torch.multinomial(probs[j], 1, generator=generators[i])[0]
    return tokens
