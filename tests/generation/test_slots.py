"""`SlotPool`: which slot a sample takes and which cached prefix a prompt is computed from (hand-worked cases;
the keys/values themselves are checked against transformers in test_engine.py)."""

from __future__ import annotations

import pytest

from torchrlhf.generation.slots import MIN_CACHED_PREFIX, SlotPool, shared_prefix_len

A = list(range(100, 140))  # 40 tokens


@pytest.mark.parametrize("a, b, n", [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2),
                                     ([1, 2, 3], [1, 9, 3], 1), ([5], [6], 0), (A, A[:17] + [0] + A[18:], 17)])
def test_shared_prefix_len(a, b, n):
    assert shared_prefix_len(a, b) == n


def test_take_prefers_slots_that_hold_nothing_then_drops_the_lowest_cached():
    pool = SlotPool(4, {0: A, 2: A[:20]})
    assert [pool.take(), pool.take()] == [1, 3]
    assert pool.take() == 0 and set(pool.cached) == {2}
    assert pool.take() == 2 and pool.cached == {} and pool.free == set()


def test_a_prompt_continuing_all_a_slot_holds_is_computed_in_that_slot():
    pool = SlotPool(3, {1: A[:20], 2: A[:30]})
    assert pool.place(A + [7, 8]) == (2, 30, None)  # the longest of the two
    assert pool.free == {0, 1} and pool.cached == {1: A[:20]}


def test_a_partly_shared_prefix_is_copied_into_a_fresh_slot_and_stays_cached():
    pool = SlotPool(3, {1: A})
    prompt = A[:30] + [1, 2, 3]  # shares 30 of 33 tokens, diverges from what slot 1 holds
    assert pool.place(prompt) == (0, 30, 1)
    assert pool.cached == {1: A} and pool.free == {1, 2}  # the source stays free and cached


def test_a_prefix_below_the_minimum_or_half_the_prompt_is_not_used():
    short = A[:MIN_CACHED_PREFIX - 1]
    pool = SlotPool(2, {1: short})
    assert pool.place(short + [1, 2]) == (0, 0, None)  # 15 shared tokens: below the minimum
    pool = SlotPool(2, {1: A[:20]})
    assert pool.place(A[:20] + list(range(21))) == (0, 0, None)  # 20 of 41: under half
    assert pool.place(A[:20] + list(range(20))) == (1, 20, None)  # 20 of 40: half


def test_the_last_prompt_token_is_always_computed():
    """A prompt equal to a cached prefix reuses all but its last token, which gives the first logits."""
    pool = SlotPool(2, {0: A})
    assert pool.place(A) == (1, 39, 0)


def test_when_every_free_slot_is_cached_the_copy_source_may_be_the_slot_taken():
    """With one free slot left, the source is that slot itself: nothing to copy, the prefix is overwritten
    after the shared part, so it leaves the cache."""
    pool = SlotPool(1, {0: A})
    assert pool.place(A[:30] + [1, 2]) == (0, 30, None)
    assert pool.cached == {} and pool.free == set()


def test_give_back_records_what_the_slot_holds_and_move_overwrites_the_destination():
    pool = SlotPool(3, {})
    a, b = pool.take(), pool.take()
    pool.give_back(a, A)
    pool.give_back(b)
    assert pool.cached == {a: A} and pool.free == {0, 1, 2}
    c = pool.take()
    assert c == 1
    pool.move(0, 1)  # the sample in slot 1 moves to slot 0, whose prefix is overwritten
    assert pool.cached == {} and pool.free == {1, 2}
