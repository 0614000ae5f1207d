"""The controller's view of a group call in flight: `GroupFuture`, its `WorkerError`, and `wait_all`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from torchrlhf.runtime import stall
from torchrlhf.runtime.registry import Failure


class WorkerError(RuntimeError):
    """A worker method failed (or its rank died); names group, method and rank.

    ``unreachable``: no answer came back (the process died, or the call timed out), as opposed to an
    exception the method raised.
    """

    def __init__(self, group: str, method: str, rank: int, remote_traceback: str, unreachable: bool = False) -> None:
        self.group, self.method, self.rank, self.remote_traceback = group, method, rank, remote_traceback
        self.unreachable = unreachable
        super().__init__(
            f"worker group {group!r}, method {method!r} failed on rank {rank}:\n{remote_traceback.rstrip()}"
        )


class GroupFuture:
    """The pending answers of one group call; `wait()` returns the collected result.

    Fails fast: the first failed rank raises `WorkerError` without waiting for the others (which may be
    stuck in a collective with the failed rank).
    """

    def __init__(self, group: str, method: str, ranks: list[int], futs: list, collect: Callable[[list], Any]):
        self.group, self.method, self._ranks, self._collect = group, method, ranks, collect
        self._results: list[Any] = [None] * len(futs)
        self.error: WorkerError | None = None  # the first failure, once one happened
        self._pending = len(futs)
        self._lock = threading.Lock()
        self._event = threading.Event()
        for i, f in enumerate(futs):
            f.add_done_callback(lambda f, i=i: self._on_done(i, f))

    def _on_done(self, i: int, fut: Any) -> None:
        rank = self._ranks[i]
        err = None
        try:
            value = fut.value()
        except Exception as e:
            value = None
            err = WorkerError(
                self.group, self.method, rank,
                f"rank {rank} did not answer (its process died, or the call timed out): {e}", unreachable=True,
            )
        if isinstance(value, Failure):
            err = WorkerError(self.group, self.method, rank, value.text)
        with self._lock:
            self._results[i] = value
            self._pending -= 1
            if err is not None and self.error is None:
                self.error = err
            if self.error is not None or self._pending == 0:
                self._event.set()

    def done(self) -> bool:
        """Every rank answered, or one failed."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """The collected answer. Without ``timeout``, a call running past the stall timeout raises
        `StallError` with every rank's status (`runtime.stall`)."""
        limit = stall.stall_timeout() if timeout is None else None
        if limit is not None:
            if not self._event.wait(limit):
                raise stall.StallError(stall.report(f"{self.group}.{self.method}", limit))
        elif not self._event.wait(timeout):
            raise TimeoutError(f"{self.group}.{self.method} did not finish in {timeout}s")
        if self.error is not None:
            raise self.error
        return self._collect(self._results)


def wait_all(*futures: GroupFuture, poll_s: float = 0.05) -> list[Any]:
    """Wait for several group calls that depend on each other (two halves of one collective).

    Raises the first failure as soon as it happens: the other call may never finish once its peer died;
    past the stall timeout, `StallError` with every rank's status.
    """
    start, limit = time.perf_counter(), stall.stall_timeout()
    while not all(f.done() for f in futures):
        failed = next((f for f in futures if f.done() and f.error is not None), None)
        if failed is not None:
            raise failed.error
        if limit is not None and time.perf_counter() - start > limit:
            pending = next(f for f in futures if not f.done())
            raise stall.StallError(stall.report(f"{pending.group}.{pending.method}", limit))
        time.sleep(poll_s)
    return [f.wait() for f in futures]
