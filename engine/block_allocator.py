"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and a block table per sequence.

Plain Python over integers (no torch), so the scheduler can be tested with hypothesis on CPU. The
scheduler asks `grow` for room before it schedules tokens; a False answer is a normal outcome that it
acts on (wait or preempt), never an exception. Reference counts let several tables share a block
(`fork`), which is what prefix sharing and parallel sampling need.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockAllocator:
    """Owns block ids 0..num_blocks-1 and the block table of every sequence that holds any."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[Hashable, list[int]] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._tables.get(seq_id, [])

    def extra_blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(seq_id)))

    # -- changes -------------------------------------------------------------------------------
    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make seq_id's table cover num_tokens tokens. False (and no change) if blocks are short."""
        table = self._tables.get(seq_id)
        needed = -(-num_tokens // self.block_size) - (len(table) if table is not None else 0)
        if needed <= 0:  # the common case, a decode inside its last block: nothing to do
            return True
        if needed > len(self._free):
            return False
        if table is None:
            table = self._tables[seq_id] = []
        for _ in range(needed):
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)
        return True

    def release(self, seq_id: Hashable) -> None:
        """Drop seq_id's table; blocks no other table shares go back to the free list."""
        for block in self._tables.pop(seq_id, []):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def fork(self, src_id: Hashable, dst_id: Hashable, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give dst_id a table sharing src_id's full blocks (copy-on-write for the partial tail).

        Returns the (src_block, dst_block) copies the runner must make for the tail block, or None
        (and no change) when no block is free for that copy.
        """
        if dst_id in self._tables:
            raise ValueError(f"sequence {dst_id!r} already holds blocks")
        src = self._tables.get(src_id, [])
        num_full = min(num_tokens // self.block_size, len(src))
        has_tail = len(src) > num_full
        if has_tail and not self._free:
            return None
        shared = src[:num_full]
        for block in shared:
            self._ref_counts[block] += 1
        table = list(shared)
        copies: list[tuple[int, int]] = []
        if has_tail:
            block = self._free.popleft()
            self._ref_counts[block] = 1
            table.append(block)
            copies.append((src[num_full], block))
        self._tables[dst_id] = table
        return copies

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless free + used = total and every block is owned as counted."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        owners = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"sequence {seq_id!r} holds a block twice")
            for block in table:
                owners[block] += 1
        for block in range(self.num_blocks):
            if owners[block] != self._ref_counts[block]:
                raise AssertionError(
                    f"block {block}: {owners[block]} owners but ref count {self._ref_counts[block]}"
                )
        free_set = set(free)
        used = {b for b in range(self.num_blocks) if owners[b] > 0}
        if free_set & used:
            raise AssertionError(f"blocks both free and used: {sorted(free_set & used)[:8]}")
        if len(free_set) + len(used) != self.num_blocks:
            raise AssertionError(f"free {len(free_set)} + used {len(used)} != total {self.num_blocks}")
