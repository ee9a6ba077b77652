"""Per-step attention metadata and the context that carries it through one forward pass.

The runner fills one AttentionMetadata per step from its persistent step buffers (device tensors of
fixed capacity, so a CUDA graph captured over them replays with new contents) and sets it for the
duration of `model.forward` (`forward_context`), so the model's signature stays
`forward(input_ids, positions)` and only the attention layers read it. Each backend adds what it needs
once per step in its `prepare(meta)` (for example the torch reference's gather indices).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.kernels.planned_decode_attention import DecodePlan


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the batch and in the paged cache.

    Tokens of all sequences are flattened into one dimension (num_tokens). Sequence i owns the tokens
    query_start_loc_cpu[i]:query_start_loc_cpu[i+1], and after this step its context holds seq_lens[i]
    tokens. Sequences 0..num_decodes-1 have exactly one query token each (decodes come first). Rows of
    a padded batch (CUDA graphs) have seq_len 0 and slot -1: attention writes and reads nothing there.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int32: block * block_size + offset of each new token; -1 skips
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32; entries past a table's end are junk
    seq_lens: torch.Tensor  # [num_seqs] int32 on the device: context length after this step
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 on the device: sequence i's first token row
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]  # [num_seqs + 1]
    num_decodes: int
    block_size: int
    max_decode_len: int = 0  # longest decode context this step (host value; the torch backend's gather width)
    max_prefill_len: int = 0  # longest prefill chunk this step (host value; sizes the prefill kernel's grid)
    # Filled by the backend's prepare(), once per step, shared by every layer:
    decode_slots: torch.Tensor | None = None  # torch: [num_decodes, max_decode_len] cache slot per position
    decode_mask: torch.Tensor | None = None  # torch: [num_decodes, max_decode_len] True where it exists
    # Triton: the decode kernel's context splits, and where the planned kernel runs (a mixed step, or
    # many decodes) its work items (a DecodePlan), chosen by the step's first layer for all of them
    decode_splits: int = 0
    decode_plan: DecodePlan | None = None
    # A step with prompt chunks replayed from a captured graph (engine.runner): the kernels' grids are
    # fixed by the graph's token count, not by the step. The decode kernel covers graph_decodes rows
    # with decode_seq_lens (0 past the step's decodes: those rows output zeros, which the prefill
    # kernel then overwrites where they are prompt tokens); the prefill kernel covers graph_prefills
    # chunks through prefill_* (absolute token offsets; chunks past the step's are empty).
    graph_decodes: int = 0
    graph_prefills: int = 0
    decode_seq_lens: torch.Tensor | None = None  # [>= graph_decodes]
    prefill_query_start_loc: torch.Tensor | None = None  # [graph_prefills + 1]
    prefill_seq_lens: torch.Tensor | None = None  # [graph_prefills]
    prefill_block_tables: torch.Tensor | None = None  # [graph_prefills, max_blocks_per_seq]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def query_len(self, i: int) -> int:
        return self.query_start_loc_cpu[i + 1] - self.query_start_loc_cpu[i]


# (cos_sin [max_positions, head_dim] float32: cos of each frequency, then sin; positions [num_tokens]
# int64 or int32): what a backend with fuses_rotary needs to rotate q and k itself (neox halves).
RotaryInputs = tuple[torch.Tensor, torch.Tensor]


def context_slots(block_tables: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """[batch, length] int64 cache slot of each context position, from block tables [batch, max_blocks]."""
    num_blocks = -(-length // block_size)
    offsets = torch.arange(block_size, device=block_tables.device)
    return (block_tables[:, :num_blocks, None].long() * block_size + offsets).flatten(1)[:, :length]


_current: contextvars.ContextVar[AttentionMetadata | None] = contextvars.ContextVar(
    "attention_metadata", default=None
)


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata) -> Iterator[None]:
    # Each forward pass plans its decodes afresh on the device: a plan launched by one pass (a warm-up)
    # must not stand in for the next (a CUDA graph's capture, which must record the planning launch).
    metadata.decode_plan = None
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
