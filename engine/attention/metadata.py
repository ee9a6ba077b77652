"""Per-step attention metadata and the context that carries it through one forward pass.

The runner builds one AttentionMetadata per step and sets it for the duration of `model.forward`
(`forward_context`), so the model's signature stays `forward(input_ids, positions)` and only the
attention layers read it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the batch and in the paged cache.

    Tokens of all sequences are flattened into one dimension (num_tokens). Sequence i owns the tokens
    query_start_loc_cpu[i]:query_start_loc_cpu[i+1], and after this step its context holds seq_lens_cpu[i]
    tokens.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset for each new token
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    seq_lens_cpu: list[int]  # context length after this step
    query_start_loc_cpu: list[int]
    query_lens_cpu: list[int]
    num_decodes: int  # sequences 0..num_decodes-1 have exactly one query token each
    block_size: int
    # For the decodes, built once per step and shared by every layer:
    decode_slots: torch.Tensor | None = (
        None  # [num_decodes, max_decode_len] cache slot of each context position
    )
    decode_mask: torch.Tensor | None = (
        None  # [num_decodes, max_decode_len] bool, True where a position exists
    )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def context_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[batch, length] cache slot of each context position, from block tables [batch, max_blocks]."""
    num_blocks = -(-length // block_size)
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables[:, :num_blocks, None] * block_size + offsets).flatten(1)[:, :length]


_current: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "attention_metadata", default=None
)


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    token = _current.set(metadata)
    try:
        yield
    finally:
        _current.reset(token)


def current_metadata() -> AttentionMetadata:
    metadata = _current.get()
    if metadata is None:
        raise RuntimeError("attention called outside forward_context: the runner sets the step's metadata")
    return metadata
