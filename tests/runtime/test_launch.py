"""The restart attempt's rendezvous name (`runtime.launch.agreed_attempt`): every rank of an attempt agrees on it,
whatever the killed attempt left in torchrun's store and whichever rank starts first. torchrun's restart count
cannot name it: after a restart across nodes, only the failed node's agent has counted it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchrlhf.runtime.launch import agreed_attempt


def _attempt(store: dist.Store, world: int, rank0_after_s: float = 0.0) -> dict[int, str]:
    """One attempt's ranks on threads; rank 0 starts ``rank0_after_s`` after the others."""
    names: dict[int, str] = {}

    def rank(r: int) -> None:
        names[r] = agreed_attempt(store, r, world, timeout=timedelta(seconds=60), poll_s=0.005)

    threads = {r: threading.Thread(target=rank, args=(r,)) for r in range(world)}
    for r in range(1, world):
        threads[r].start()
    time.sleep(rank0_after_s)
    threads[0].start()
    for t in threads.values():
        t.join(timeout=60)
    assert sorted(names) == list(range(world)), names
    return names


def test_every_rank_of_an_attempt_agrees_on_a_name_no_earlier_attempt_used():
    store = dist.HashStore()
    first = _attempt(store, 3)
    assert len(set(first.values())) == 1
    # the next attempt's workers start while the killed attempt's answers are still in the store
    second = _attempt(store, 3, rank0_after_s=0.2)
    assert len(set(second.values())) == 1 and second[0] != first[0]
    third = _attempt(store, 3)
    assert len(set(third.values())) == 1 and third[0] not in (first[0], second[0])


def test_a_rank_that_never_comes_is_named_after_the_timeout():
    store = dist.HashStore()
    with pytest.raises(TimeoutError, match=r"rank 0: ranks \[1, 2\] did not reach the rendezvous"):
        agreed_attempt(store, 0, 3, timeout=timedelta(seconds=0.3), poll_s=0.01)
    with pytest.raises(TimeoutError, match="rank 2: rank 0 did not answer"):
        agreed_attempt(store, 2, 3, timeout=timedelta(seconds=0.3), poll_s=0.01)
