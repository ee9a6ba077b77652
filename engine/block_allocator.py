"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, a block table per sequence, and the
prefix cache (full blocks kept by the hash of their tokens after their sequence is done).

Plain Python over integers (no torch), so the scheduler can be tested with hypothesis on CPU. The
scheduler asks `grow` (or `allocate`, for a sequence starting on cached blocks) for room before it
schedules tokens; a False answer is a normal outcome that it acts on (wait or preempt), never an
exception. Reference counts let several tables share a block: a cached prefix, or `fork`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

BlockHash = bytes  # 16 bytes: see hash_block


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The identity of a full block: a 128-bit BLAKE2b digest of its parent block's hash and its own
    token ids (None for a sequence's first block).

    Chaining makes a block's hash stand for every token before it too, so one dictionary lookup per
    block finds the longest cached prefix, and equal hashes mean equal positions. Worked example, block
    size 2, prompt [7, 8, 9, 10, 11]: h0 = H(none, [7, 8]), h1 = H(h0, [9, 10]); token 11 is a partial
    block and is never hashed. A prompt [7, 8, 9, 10, 12, 13] finds h0 and h1 (4 tokens cached); one
    [5, 8, 9, 10] misses at h0 and so shares nothing, although its second block holds [9, 10] too.

    Collisions are left to the digest's width instead of comparing token ids on a match: at 128 bits,
    even 2^40 distinct blocks collide with probability about 2^-49, far below the rate of hardware
    memory errors, while comparing would mean keeping block_size token ids beside every cached block
    and reading them on every hit. Python's built-in `hash` would not do: 64 bits, and not collision
    resistant (an int hashes to itself), so a client could craft two prompts whose blocks collide and
    read another request's KV.
    """
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockAllocator:
    """Owns block ids 0..num_blocks-1 and the block table of every sequence that holds any.

    Each block is in one of three states:
    - used: referenced by at least one table (its reference count is the number of tables);
    - cached: referenced by none, but holding the KV of a full block whose hash is known, kept so a
      later sequence with the same prefix can share it (`match_prefix`, `allocate`);
    - free: neither.
    A new block comes from the free blocks first; only when there are none is the least recently used
    cached block evicted (its hash forgotten). So the blocks available to a sequence are free + cached.
    Nothing becomes cached unless the scheduler registers hashes (`cache_blocks`): without prefix
    caching every released block is free, as before.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token, got {num_blocks} x {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks with a hash, least recently used first (the next to be evicted).
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        self._tables: dict[Hashable, list[int]] = {}
        # How many leading blocks of each table cache_blocks has gone through (matched ones included).
        self._num_hashed: dict[Hashable, int] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks neither referenced nor cached."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks kept for their prefix; evicted when a free block is needed."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - len(self._free) - len(self._cached)

    @property
    def num_available_blocks(self) -> int:
        """Blocks a new allocation may take: free, or cached (evicted on the way)."""
        return len(self._free) + len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self._tables.get(seq_id, [])

    def extra_blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(seq_id)))

    def match_prefix(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """The blocks holding the longest run of the first max_blocks of block_hashes (used or cached).

        Changes nothing: `allocate` takes them. The hashes are chained (hash_block), so the run stops
        at the first miss."""
        blocks: list[int] = []
        by_hash = self._by_hash
        for block_hash in block_hashes[:max_blocks]:
            block = by_hash.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # -- changes -------------------------------------------------------------------------------
    def grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make seq_id's table cover num_tokens tokens. False (and no change) if blocks are short."""
        table = self._tables.get(seq_id)
        needed = -(-num_tokens // self.block_size) - (len(table) if table is not None else 0)
        if needed <= 0:  # the common case, a decode inside its last block: nothing to do
            return True
        if needed > len(self._free) + len(self._cached):
            return False
        if table is None:
            table = self._tables[seq_id] = []
        for _ in range(needed):
            table.append(self._take())
        return True

    def allocate(self, seq_id: Hashable, cached_blocks: Sequence[int], num_tokens: int) -> bool:
        """Give seq_id, which holds no blocks, a table that starts with cached_blocks (from
        match_prefix: shared, their tokens not computed again) and covers num_tokens tokens.

        False (and no change) when the new blocks needed exceed what is available once the cached
        blocks taken here stop being evictable."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        needed = self.blocks_for(num_tokens) - len(cached_blocks)
        if needed < 0:
            raise ValueError(f"{len(cached_blocks)} cached blocks are more than {num_tokens} tokens fill")
        unreferenced = sum(1 for block in cached_blocks if self._ref_counts[block] == 0)
        if needed > len(self._free) + len(self._cached) - unreferenced:
            return False
        for block in cached_blocks:
            if self._ref_counts[block] == 0:
                del self._cached[block]
            self._ref_counts[block] += 1
        table = self._tables[seq_id] = list(cached_blocks)
        for _ in range(needed):
            table.append(self._take())
        if cached_blocks:
            self._num_hashed[seq_id] = len(cached_blocks)
        return True

    def _take(self) -> int:
        """An unreferenced block, referenced once: a free one, else the least recently used cached
        one, whose hash is forgotten. The caller has checked that one is available."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._cached.popitem(last=False)
            del self._by_hash[self._block_hashes[block]]  # type: ignore[arg-type]  # cached: hashed
            self._block_hashes[block] = None
        self._ref_counts[block] = 1
        return block

    def cache_blocks(self, seq_id: Hashable, block_hashes: Sequence[BlockHash], num_blocks: int) -> None:
        """Register the hashes of seq_id's first num_blocks blocks, which must be full, their tokens
        known and their KV computed (or being computed by a launched step). O(1) when there is nothing
        new, so the scheduler may call it every step; each block is hashed once, by the caller.

        A block whose hash another block already holds (two sequences with the same prompt computed
        side by side) stays unregistered: it becomes free, not cached, when released."""
        start = self._num_hashed.get(seq_id, 0)
        if num_blocks <= start:
            return
        table = self._tables[seq_id]
        if num_blocks > len(table):
            raise ValueError(f"sequence {seq_id!r} holds {len(table)} blocks, not {num_blocks}")
        hash_of, by_hash = self._block_hashes, self._by_hash
        for index in range(start, num_blocks):
            block, block_hash = table[index], block_hashes[index]
            if hash_of[block] is None and block_hash not in by_hash:
                hash_of[block] = block_hash
                by_hash[block_hash] = block
        self._num_hashed[seq_id] = num_blocks

    def release(self, seq_id: Hashable) -> None:
        """Drop seq_id's table: a block no other table shares becomes cached if it has a hash, else free.

        The table is walked from its end, so a sequence's last blocks are the first to be evicted and
        its first ones (the prefix other prompts are most likely to share) the last: evicting a
        leading block would make every block after it unreachable anyway."""
        self._num_hashed.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_hashes[block] is None:
                    self._free.append(block)
                else:
                    self._cached[block] = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block and hash (benchmarks between levels, tests); returns how many
        cached blocks became free. Blocks in use keep their KV and tables but lose their hashes."""
        count = len(self._cached)
        self._free.extend(self._cached)
        self._cached.clear()
        self._by_hash.clear()
        self._block_hashes = [None] * self.num_blocks
        return count

    def fork(self, src_id: Hashable, dst_id: Hashable, num_tokens: int) -> list[tuple[int, int]] | None:
        """Give dst_id a table sharing src_id's full blocks (copy-on-write for the partial tail).

        Returns the (src_block, dst_block) copies the runner must make for the tail block, or None
        (and no change) when no block is available for that copy.
        """
        if dst_id in self._tables:
            raise ValueError(f"sequence {dst_id!r} already holds blocks")
        src = self._tables.get(src_id, [])
        num_full = min(num_tokens // self.block_size, len(src))
        has_tail = len(src) > num_full
        if has_tail and not self.num_available_blocks:
            return None
        shared = src[:num_full]
        for block in shared:
            self._ref_counts[block] += 1
        table = list(shared)
        copies: list[tuple[int, int]] = []
        if has_tail:
            block = self._take()
            table.append(block)
            copies.append((src[num_full], block))
        self._tables[dst_id] = table
        num_hashed = min(self._num_hashed.get(src_id, 0), num_full)
        if num_hashed:
            self._num_hashed[dst_id] = num_hashed
        return copies

    # -- invariants ----------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError unless every block is exactly one of free, cached or used, free + cached
        + used = total, each reference count is the number of tables holding the block, and the hash
        index and the blocks' hashes agree (a cached block has a hash, a free one none)."""
        free = list(self._free)
        free_set = set(free)
        if len(free_set) != len(free):
            raise AssertionError("a block is on the free list twice")
        cached_set = set(self._cached)
        owners = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"sequence {seq_id!r} holds a block twice")
            if self._num_hashed.get(seq_id, 0) > len(table):
                raise AssertionError(f"sequence {seq_id!r}: more blocks hashed than held")
            for block in table:
                owners[block] += 1
        for block in range(self.num_blocks):
            if self._ref_counts[block] < 0:
                raise AssertionError(f"block {block}: negative ref count {self._ref_counts[block]}")
            if owners[block] != self._ref_counts[block]:
                raise AssertionError(
                    f"block {block}: {owners[block]} owners but ref count {self._ref_counts[block]}"
                )
        used = {b for b in range(self.num_blocks) if owners[b] > 0}
        for name, one, other in (
            ("free and used", free_set, used),
            ("free and cached", free_set, cached_set),
            ("cached and used", cached_set, used),
        ):
            if one & other:
                raise AssertionError(f"blocks both {name}: {sorted(one & other)[:8]}")
        if len(free_set) + len(cached_set) + len(used) != self.num_blocks:
            raise AssertionError(
                f"free {len(free_set)} + cached {len(cached_set)} + used {len(used)} != total {self.num_blocks}"
            )
        if any(self._block_hashes[b] is not None for b in free_set):
            raise AssertionError("a free block has a hash")
        if any(self._block_hashes[b] is None for b in cached_set):
            raise AssertionError("a cached block has no hash")
        hashed = {b: h for b, h in enumerate(self._block_hashes) if h is not None}
        if len(hashed) != len(self._by_hash) or any(self._by_hash.get(h) != b for b, h in hashed.items()):
            raise AssertionError("the hash index and the blocks' hashes disagree")
