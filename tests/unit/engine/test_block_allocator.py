"""The block allocator: exact behaviour on small cases, and its invariants under any sequence of operations."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.block_allocator import BlockAllocator


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
