"""Run worker calls on one long-lived thread per process whenever it is free.

RPC runs each incoming call on one of a pool of threads. Every thread that runs torch ops on CPU gets
its own OpenMP team. Once a process holds more OpenMP worker threads than it has CPUs, libgomp
throttles its spin-wait to about a hundred iterations, so each parallel region must wake a sleeping
thread. Measured on 2 cores with 2 threads per op: the same actor update took 1.42 s on one thread and
1.96 s once its calls were spread over the pool; a one-process GRPO step went from 4.74 to 3.31 s
(`tools/bench/bench_vs_trl.py`, arithmetic setting).

Calls therefore run on this process's compute thread. A call that arrives while that thread is busy
(asynchronous training overlaps weight receives with generation) still runs at once on its own RPC
thread, as before. No call ever waits behind another, so ordering and deadlock behaviour are unchanged.

The controller's main thread is the other source of teams: its tensor ops are small, but the first one
that enters a parallel region (after the first step of a one-process run) gave it a team, and from
then on the compute thread's workers slept between regions. `reserve_intra_op_threads` leaves the
calling thread one intra-op thread and gives the compute thread the process's count.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_busy = threading.Lock()  # held while a call runs on the compute thread
_tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()
_reserved_threads: int | None = None  # the process's intra-op count, once `reserve_intra_op_threads` took it


def _loop() -> None:
    while True:
        fn, fut = _tasks.get()
        try:
            fut.set_result(fn())
        except BaseException as e:  # the caller re-raises it on its own thread
            fut.set_exception(e)


def _ensure_thread() -> None:
    global _thread
    with _start_lock:
        if _thread is None:
            # daemon: a call stuck in a collective must not keep the interpreter from exiting
            _thread = threading.Thread(target=_loop, name="torchrlhf-compute", daemon=True)
            _thread.start()


def run(fn: Callable[[], T]) -> T:
    """``fn()`` on the compute thread if it is free, else right here; returns its result or raises its error."""
    if not _busy.acquire(blocking=False):
        return fn()
    try:
        _ensure_thread()
        fut: Future = Future()
        _tasks.put((fn, fut))
        return fut.result()
    finally:
        _busy.release()


def reserve_intra_op_threads() -> None:
    """Give this process's intra-op threads to the compute thread; the calling thread keeps one.

    Call it on the thread that only coordinates (`runtime.launch` does, on every rank's main thread),
    before any call runs on the compute thread. Threads that start using torch later get the
    process's count as before.
    """
    global _reserved_threads
    if _reserved_threads is None:  # a second launch in this process (a notebook) finds this thread at 1 already
        _reserved_threads = torch.get_num_threads()  # also settles this thread's own count before the change
    threads = _reserved_threads
    torch.set_num_threads(1)
    run(lambda: torch.set_num_threads(threads))
