"""The block allocator: exact behaviour on small cases, and its invariants under any sequence of
operations, the prefix cache's included (a model of reference counts, hashes and LRU order beside it)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_allocator import BlockAllocator, hash_block


def test_grow_allocates_whole_blocks_in_order():
    allocator = BlockAllocator(num_blocks=4, block_size=4)
    assert allocator.grow("a", 5)
    assert allocator.block_table("a") == [0, 1]
    assert allocator.grow("a", 8)  # still two blocks
    assert allocator.block_table("a") == [0, 1]
    assert allocator.grow("b", 1)
    assert allocator.block_table("b") == [2]
    assert allocator.num_free_blocks == 1


def test_grow_beyond_free_blocks_says_no_and_changes_nothing():
    allocator = BlockAllocator(num_blocks=3, block_size=4)
    assert allocator.grow("a", 8)
    assert not allocator.grow("b", 9)
    assert allocator.block_table("b") == []
    assert allocator.num_free_blocks == 1
    allocator.check_integrity()


def test_release_returns_blocks_and_fork_shares_full_blocks():
    allocator = BlockAllocator(num_blocks=6, block_size=4)
    allocator.grow("a", 10)  # blocks 0, 1, 2 (the last holds 2 tokens)
    copies = allocator.fork("a", "b", 10)
    assert allocator.block_table("b")[:2] == [0, 1]  # full blocks shared
    assert copies == [(2, allocator.block_table("b")[2])]  # partial tail copied on write
    allocator.release("a")
    assert allocator.num_used_blocks == 3  # b still holds 0, 1 and its own tail
    allocator.release("b")
    assert allocator.num_free_blocks == 6
    allocator.check_integrity()


def test_check_integrity_catches_corruption():
    allocator = BlockAllocator(num_blocks=2, block_size=4)
    allocator.grow("a", 4)
    allocator._free.append(allocator.block_table("a")[0])  # a block both free and owned
    with pytest.raises(AssertionError):
        allocator.check_integrity()


def test_check_integrity_catches_a_block_both_cached_and_used():
    allocator = BlockAllocator(num_blocks=2, block_size=2)
    allocator.grow("a", 2)
    allocator.cache_blocks("a", chain([[1, 2]]), 1)
    allocator._cached[allocator.block_table("a")[0]] = None
    with pytest.raises(AssertionError, match="both cached and used"):
        allocator.check_integrity()


def chain(blocks: list[list[int]]) -> list[bytes]:
    """The chained hashes of consecutive full blocks."""
    hashes: list[bytes] = []
    for tokens in blocks:
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
    return hashes


def test_hash_chain_stands_for_the_whole_prefix():
    assert hash_block(None, [1, 2]) == hash_block(None, [1, 2]) and len(hash_block(None, [1, 2])) == 16
    # Same tokens after a different first block: a different hash (the docstring's example).
    assert chain([[7, 8], [9, 10]])[1] != chain([[5, 8], [9, 10]])[1]
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [1 << 40]) != hash_block(None, [0])  # token ids are not truncated


def test_released_blocks_stay_cached_and_are_shared_by_the_next_prompt():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    hashes = chain([[1, 2], [3, 4]])
    assert allocator.allocate("a", [], 5)  # blocks 0, 1, 2; tokens 1 2 | 3 4 | 5
    allocator.cache_blocks("a", hashes, 2)  # the two full blocks, once computed
    allocator.release("a")
    assert (allocator.num_used_blocks, allocator.num_cached_blocks, allocator.num_free_blocks) == (0, 2, 4)
    allocator.check_integrity()
    # b = 1 2 3 4 6: both full blocks found; a prompt that differs in its first block finds none.
    assert allocator.match_prefix(hashes, 2) == [0, 1]
    assert allocator.match_prefix(chain([[9, 2], [3, 4]]), 2) == []
    assert allocator.match_prefix(hashes, 1) == [0]  # never more than asked for
    assert allocator.allocate("b", [0, 1], 5)
    assert allocator.block_table("b") == [0, 1, 3]
    assert (allocator.num_used_blocks, allocator.num_cached_blocks) == (3, 0)
    # c shares them while b runs: referenced twice, freed by neither alone.
    assert allocator.allocate("c", allocator.match_prefix(hashes, 2), 4)
    assert allocator.block_table("c") == [0, 1]
    allocator.release("b")
    assert allocator.num_used_blocks == 2 and allocator.num_cached_blocks == 0
    allocator.release("c")
    assert allocator.num_cached_blocks == 2 and allocator.num_used_blocks == 0
    allocator.check_integrity()


def test_eviction_takes_free_blocks_first_then_cached_ones_least_recently_used_first():
    allocator = BlockAllocator(num_blocks=4, block_size=1)
    for seq_id, tokens in (("a", [1, 2]), ("b", [3])):
        assert allocator.grow(seq_id, len(tokens))
        allocator.cache_blocks(seq_id, chain([[t] for t in tokens]), len(tokens))
    allocator.release("b")  # block 2 cached first: least recently used
    allocator.release("a")  # then a's, from its end: block 1 (token 2) before block 0 (token 1)
    assert list(allocator._cached) == [2, 1, 0]
    assert allocator.grow("c", 1) and allocator.block_table("c") == [3]  # the free block first
    assert allocator.num_cached_blocks == 3
    assert allocator.grow("c", 3) and allocator.block_table("c") == [3, 2, 1]  # then b's, then a's tail
    assert allocator.match_prefix(chain([[1], [2]]), 2) == [0]  # a's first block is still cached
    assert not allocator.grow("d", 2)  # one block available, two needed: no change
    assert allocator.num_cached_blocks == 1
    allocator.check_integrity()


def test_allocate_counts_the_cached_blocks_it_takes_as_no_longer_available():
    allocator = BlockAllocator(num_blocks=3, block_size=1)
    allocator.grow("a", 2)
    allocator.cache_blocks("a", chain([[1], [2]]), 2)
    allocator.release("a")  # both cached; one block free
    # 2 cached + 2 new: the new ones may not evict the cached ones taken, so only 1 is available.
    assert not allocator.allocate("b", [0, 1], 4)
    assert allocator.num_cached_blocks == 2 and allocator.block_table("b") == []
    assert allocator.allocate("b", [0, 1], 3)
    assert allocator.block_table("b") == [0, 1, 2]
    allocator.check_integrity()


def test_a_hash_already_cached_is_not_registered_twice():
    allocator = BlockAllocator(num_blocks=4, block_size=2)
    hashes = chain([[1, 2]])
    for seq_id in ("a", "b"):  # the same prompt computed side by side, neither found the other
        allocator.grow(seq_id, 3)
        allocator.cache_blocks(seq_id, hashes, 1)
    allocator.release("a")
    allocator.release("b")
    assert allocator.num_cached_blocks == 1 and allocator.num_free_blocks == 3  # b's copy is free
    assert allocator.reset_prefix_cache() == 1
    assert allocator.num_free_blocks == 4 and allocator.match_prefix(hashes, 1) == []
    allocator.check_integrity()


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate / append / free / fork sequences; the model tracks token counts per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(num_blocks=16, block_size=4)
        self.tokens: dict[int, int] = {}
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 40))
    def allocate(self, num_tokens):
        seq = self.next_id
        self.next_id += 1
        before = self.allocator.num_free_blocks
        if self.allocator.grow(seq, num_tokens):
            self.tokens[seq] = num_tokens
            assert self.allocator.num_free_blocks == before - self.allocator.blocks_for(num_tokens)
        else:
            assert self.allocator.blocks_for(num_tokens) > before
            assert self.allocator.num_free_blocks == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 12))
    def append(self, data, extra):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.allocator.grow(seq, self.tokens[seq] + extra):
            self.tokens[seq] += extra
        assert len(self.allocator.block_table(seq)) == self.allocator.blocks_for(self.tokens[seq])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.allocator.release(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        dst = self.next_id
        self.next_id += 1
        if self.allocator.fork(src, dst, self.tokens[src]) is not None:
            self.tokens[dst] = self.tokens[src]
            assert len(self.allocator.block_table(dst)) == len(self.allocator.block_table(src))

    @invariant()
    def integrity(self):
        self.allocator.check_integrity()  # no block owned twice by one table; free + used = total

    def teardown(self):
        for seq in list(self.tokens):
            self.allocator.release(seq)
        assert self.allocator.num_free_blocks == self.allocator.num_blocks  # nothing leaks
        self.allocator.check_integrity()


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences of tokens from a two-letter alphabet in blocks of 2, so prefixes repeat often: admit
    (on the cached prefix), register computed blocks, grow, release, reset. A model beside the allocator
    keeps each block's references and hash and the LRU order of unreferenced hashed blocks; every
    answer of the allocator (what it matches, whether it can allocate, which block it evicts) must be
    the model's."""

    BLOCK_SIZE = 2
    NUM_BLOCKS = 8

    def __init__(self) -> None:
        super().__init__()
        self.allocator = BlockAllocator(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.refs = [0] * self.NUM_BLOCKS
        self.hash_of: dict[int, bytes] = {}
        self.lru: list[int] = []  # unreferenced hashed blocks, next to be evicted first
        self.registered: dict[int, int] = {}

    def _hashes(self, tokens: list[int]) -> list[bytes]:
        size = self.BLOCK_SIZE
        return chain([tokens[i : i + size] for i in range(0, len(tokens) - size + 1, size)])

    def _num_free(self) -> int:
        return self.NUM_BLOCKS - sum(r > 0 for r in self.refs) - len(self.lru)

    def _took_new(self, new_blocks: list[int], free_before: int) -> None:
        """The model's side of taking new blocks: free ones first, then the LRU's head, in order."""
        evicted = new_blocks[free_before:] if len(new_blocks) > free_before else []
        assert evicted == self.lru[: len(evicted)], (evicted, self.lru)
        for block in new_blocks:
            assert self.refs[block] == 0
            if block in self.hash_of:
                assert block in evicted
                del self.hash_of[block]
                self.lru.remove(block)
            self.refs[block] = 1

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def admit(self, tokens):
        seq = self.next_id
        self.next_id += 1
        hashes = self._hashes(tokens)
        max_blocks = (len(tokens) - 1) // self.BLOCK_SIZE
        cached = self.allocator.match_prefix(hashes, max_blocks)
        by_hash = {h: b for b, h in self.hash_of.items()}
        expected: list[int] = []
        for h in hashes[:max_blocks]:
            if h not in by_hash:
                break
            expected.append(by_hash[h])
        assert cached == expected
        needed = self.allocator.blocks_for(len(tokens)) - len(cached)
        unreferenced = [b for b in cached if self.refs[b] == 0]
        free_before = self._num_free()
        fits = needed <= free_before + len(self.lru) - len(unreferenced)
        assert self.allocator.allocate(seq, cached, len(tokens)) == fits
        if not fits:
            assert self.allocator.block_table(seq) == []
            return
        for block in cached:
            if self.refs[block] == 0:
                self.lru.remove(block)
            self.refs[block] += 1
        table = self.allocator.block_table(seq)
        assert table[: len(cached)] == cached
        self._took_new(table[len(cached) :], free_before)
        self.tokens[seq] = tokens
        self.registered[seq] = len(cached)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 1), min_size=1, max_size=4))
    def grow(self, data, extra):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[seq] + extra
        before = list(self.allocator.block_table(seq))
        needed = self.allocator.blocks_for(len(tokens)) - len(before)
        free_before = self._num_free()
        fits = needed <= free_before + len(self.lru)
        assert self.allocator.grow(seq, len(tokens)) == fits
        if fits:
            self._took_new(self.allocator.block_table(seq)[len(before) :], free_before)
            self.tokens[seq] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def register(self, data):
        """Its full blocks computed: register them (what the scheduler does after a step)."""
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        hashes = self._hashes(self.tokens[seq])
        table = self.allocator.block_table(seq)
        self.allocator.cache_blocks(seq, hashes, len(hashes))
        for index in range(self.registered[seq], len(hashes)):
            block = table[index]
            if block not in self.hash_of and hashes[index] not in self.hash_of.values():
                self.hash_of[block] = hashes[index]
        self.registered[seq] = max(self.registered[seq], len(hashes))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        table = self.allocator.block_table(seq)
        self.allocator.release(seq)
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0 and block in self.hash_of:
                self.lru.append(block)
        del self.tokens[seq], self.registered[seq]

    @rule()
    def reset(self):
        assert self.allocator.reset_prefix_cache() == len(self.lru)
        self.hash_of.clear()
        self.lru.clear()

    @invariant()
    def agrees_with_the_model(self):
        self.allocator.check_integrity()  # free, cached or used, never two; counts conserved
        assert min(self.refs) >= 0
        assert self.allocator.num_used_blocks == sum(r > 0 for r in self.refs)
        assert self.allocator.num_cached_blocks == len(self.lru)
        assert self.allocator.num_free_blocks == self._num_free()

    def teardown(self):
        for seq in list(self.tokens):
            self.allocator.release(seq)
        assert self.allocator.num_used_blocks == 0
        assert self.allocator.num_free_blocks + self.allocator.num_cached_blocks == self.NUM_BLOCKS
        self.allocator.check_integrity()


TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestPrefixCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
