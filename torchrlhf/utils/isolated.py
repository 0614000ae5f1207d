"""Calling user code in worker processes, each call under a time limit.

`IsolatedPool` is the one process pool behind reward functions (`RewardManager`) and agent tools
(`torchrlhf.agents`). A hung Python call cannot be interrupted in a thread, so calls run in
worker processes; when one runs past its time limit the pool's processes are killed, the call's
future fails with `CallTimeout`, the calls that were running beside it are run again, and a fresh
pool starts on demand. At most ``num_workers`` calls are in flight, so a call's clock starts when
it starts running, not when it was queued.

`submit` never blocks: a dispatcher thread feeds the pool and enforces the deadlines, and the
returned `concurrent.futures.Future` resolves to the call's result or its exception. User code
runs with the permissions of the user who launched training; only configure code you trust.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrlhf.config import load_callable

Target = Callable[..., Any] | str


class CallTimeout(TimeoutError):
    """A call ran past its time limit; its worker process was killed."""


class WorkerStartupError(RuntimeError):
    """The worker processes did not start (within ``startup_timeout_s``)."""


@dataclass
class _Job:
    future: Future
    target: Target
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 0.0


class IsolatedPool:
    """Run functions in worker processes with a per-call time limit.

    Args:
        num_workers: worker processes (and so calls in flight).
        timeout_s: default time limit of one call.
        startup_timeout_s: how long starting the workers may take (they import torch); a pool that
            does not start fails the waiting calls with `WorkerStartupError`.
    """

    def __init__(self, num_workers: int = 1, timeout_s: float = 10.0, startup_timeout_s: float = 300.0) -> None:
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"IsolatedPool: need timeout_s > 0 and num_workers >= 1, got {timeout_s}, {num_workers}")
        self.num_workers = int(num_workers)
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self._lock = threading.Lock()
        self._queue: deque[_Job] = deque()
        self._wake: Future = Future()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._pool: ProcessPoolExecutor | None = None
        self.restarts = 0  # pools killed after a timeout or a crash

    # ------------------------------------------------------------------ public
    def submit(self, target: Target, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
               timeout_s: float | None = None) -> Future:
        """Queue ``target(*args, **kwargs)``; a spec string (``pkg.mod:fn``) is loaded once per worker.

        Raises ValueError at once when ``target`` cannot be sent to a worker (a lambda, a local function).
        """
        _check_sendable(target)
        job = _Job(Future(), target, tuple(args), dict(kwargs or {}), float(timeout_s or self.timeout_s))
        with self._lock:
            self._closing = False
            self._queue.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._dispatch, name="IsolatedPool", daemon=True)
                self._thread.start()
            if not self._wake.done():
                self._wake.set_result(None)
        return job.future

    def run(self, calls: Sequence[tuple[Target, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Run ``(target, args, kwargs)`` calls and wait: each result, or the exception it ended with."""
        for target, _, _ in calls:
            _check_sendable(target)  # all before any starts, so a bad one leaves nothing running
        futures = [self.submit(target, args, kwargs) for target, args, kwargs in calls]
        wait(futures)
        return [f.exception() or f.result() for f in futures]

    def close(self) -> None:
        """Stop the workers; calls not yet finished fail with RuntimeError. A later `submit` starts anew."""
        with self._lock:
            self._closing = True
            thread = self._thread
            if not self._wake.done():
                self._wake.set_result(None)
        if thread is not None:
            thread.join()
        else:
            self._kill_pool()  # idle: the workers are kept warm between calls

    def __enter__(self) -> IsolatedPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ dispatcher thread
    def _dispatch(self) -> None:
        inflight: dict[Future, tuple[_Job, float]] = {}
        while True:
            with self._lock:
                if self._closing:
                    pending = [job for job, _ in inflight.values()] + list(self._queue)
                    self._queue.clear()
                    break
                if self._wake.done():
                    self._wake = Future()
                wake = self._wake
                if not self._queue and not inflight:
                    self._thread = None  # idle: exit; the next submit starts a new thread
                    return
            if self._queue and len(inflight) < self.num_workers:
                try:
                    pool = self._get_pool()
                except WorkerStartupError as e:
                    with self._lock:
                        failed, self._queue = list(self._queue), deque()
                    for job in failed:
                        if _start(job.future):
                            _resolve(job.future, e, None)
                    continue
                while self._queue and len(inflight) < self.num_workers:
                    with self._lock:
                        job = self._queue.popleft()
                    if not _start(job.future):
                        continue  # cancelled by its owner
                    fut = pool.submit(_call_in_worker, job.target, job.args, job.kwargs)
                    inflight[fut] = (job, time.monotonic() + job.timeout_s)
            nearest = min((deadline for _, deadline in inflight.values()), default=None)
            timeout = None if nearest is None else max(0.0, nearest - time.monotonic())
            done, _ = wait([*inflight, wake], timeout=timeout, return_when=FIRST_COMPLETED)
            broken = False
            for fut in done:
                if fut is wake:
                    continue
                job, _ = inflight.pop(fut)
                exc = fut.exception()
                broken |= isinstance(exc, BrokenProcessPool)
                _resolve(job.future, exc, None if exc is not None else fut.result())
            now = time.monotonic()
            expired = [f for f, (_, deadline) in inflight.items() if deadline <= now]
            if expired or broken:
                self.restarts += 1
                for fut in expired:
                    job, _ = inflight.pop(fut)
                    _resolve(job.future, CallTimeout(f"call ran past its time limit of {job.timeout_s}s"), None)
                # Killing the pool also stops the calls running beside the hung one: run those again, first.
                with self._lock:
                    self._queue.extendleft(job for job, _ in reversed(list(inflight.values())))
                inflight.clear()
                self._kill_pool()
        self._kill_pool()
        with self._lock:
            self._thread = None
        for job in pending:
            if _start(job.future):
                _resolve(job.future, RuntimeError("IsolatedPool was closed before the call finished"), None)

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.num_workers, mp_context=_mp_context(), initializer=_init_worker,
                initargs=(sys.path, os.getpid())
            )
            # Wait until every worker answers, so start-up does not count against a call's time limit.
            seen: set[int] = set()
            deadline = time.monotonic() + self.startup_timeout_s
            while len(seen) < self.num_workers:
                pings = [self._pool.submit(_ping) for _ in range(self.num_workers)]
                done, pending = wait(pings, timeout=max(0.0, deadline - time.monotonic()))
                if pending or any(f.exception() for f in done):
                    self._kill_pool()
                    raise WorkerStartupError(f"worker processes did not start within {self.startup_timeout_s}s")
                seen.update(f.result() for f in done)
        return self._pool

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for p in processes:
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.join(timeout=5)


def _check_sendable(target: Target) -> None:
    if isinstance(target, str):
        return
    try:
        pickle.dumps(target)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same thing here
        raise ValueError(
            f"function {target!r} cannot be sent to a worker process ({e}); define it at module level, "
            "pass it as 'pkg.mod:fn' or '/path/file.py:fn', or run it in-process (isolate=False)"
        ) from e


def _start(future: Future) -> bool:
    """Mark a queued call's future running (a call run again after a pool kill already is); False if cancelled."""
    return future.running() or (not future.done() and future.set_running_or_notify_cancel())


def _resolve(future: Future, exc: BaseException | None, result: Any) -> None:
    if future.done():  # cancelled by its owner meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


_WORKER_FNS: dict[str, Callable[..., Any]] = {}


def _mp_context() -> multiprocessing.context.BaseContext:
    # forkserver: after a timeout kills the pool, new workers fork from a server that has already
    # imported this module (and torch), instead of paying the imports again as spawn would.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def _init_worker(sys_path: list[str], owner: int) -> None:
    # The forkserver may have started before the caller extended sys.path: use the caller's path.
    sys.path[:] = list(sys_path)
    torch.set_num_threads(1)
    threading.Thread(target=_exit_after, args=(owner,), daemon=True, name="isolated-owner-watch").start()


def _exit_after(owner: int) -> None:
    """End this worker once ``owner`` (the process that made the pool) has exited. A SIGKILLed rank gets no
    shutdown: its workers would wait on their queue forever and keep the forkserver alive, so a job that
    torchrun restarts would leave them behind at every restart."""
    try:
        fd = os.pidfd_open(owner)
        select.select([fd], [], [])  # readable once the owner has exited
    except (AttributeError, OSError):  # no pidfd here (not Linux, an old kernel), or the owner is gone: poll
        while True:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # alive, under another user
                pass
            time.sleep(2.0)
    os._exit(1)


def _ping() -> int:
    time.sleep(0.05)  # long enough that one fast worker cannot answer every ping
    return os.getpid()


def _call_in_worker(target: Target, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Runs in a worker process: load a named function once per process, then call it."""
    if isinstance(target, str):
        if target not in _WORKER_FNS:
            _WORKER_FNS[target] = load_callable(target)
        target = _WORKER_FNS[target]
    return target(*args, **kwargs)
