"""The worker side of every group call: this process's workers and process groups, and the RPC targets.

Each rank keeps the workers it hosts (roles colocated on it) and the process groups the controller had it
create, by name. The controller reaches them only through the module-level functions below, which RPC
runs on the rank (on its compute thread when it is free).
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from torchrlhf.runtime import compute_thread, profiling, stall
from torchrlhf.runtime.parallel_dims import ParallelDims
from torchrlhf.runtime.worker import Worker, WorkerContext, set_current_context

_process_groups: dict[str, dist.ProcessGroup | None] = {}
_workers: dict[str, Worker] = {}


class Failure:
    """What a worker sends back instead of raising: the formatted remote traceback."""

    def __init__(self, text: str) -> None:
        self.text = text


def local_worker(name: str) -> Worker:
    """Worker side: the instance of group ``name`` living in this process (roles colocated on this rank)."""
    if name not in _workers:
        raise LookupError(f"no worker group {name!r} in this process (rank {dist.get_rank()}); colocated roles "
                          f"here: {sorted(_workers)}")
    return _workers[name]


def process_group(key: str) -> dist.ProcessGroup:
    """Worker side: the process group the controller created with `new_process_group(key, ranks)`."""
    if key not in _process_groups:
        raise LookupError(f"no process group {key!r} on rank {dist.get_rank()}; this rank is not one of its members")
    return _process_groups[key]


def forget_all() -> None:
    """At runtime shutdown, before the process group goes: close every worker of this process, then forget them."""
    for worker in reversed(list(_workers.values())):  # the reverse of construction: users before what they use
        worker.close()
    _workers.clear()
    stall.forget_busy()
    _process_groups.clear()


# ---------------------------------------------------------------------- RPC targets
def new_group(key: str, ranks: list[int]) -> None:
    """On every live world rank: create the group's process group (collective)."""
    pg = dist.new_group(ranks)
    if dist.get_rank() in ranks:
        _process_groups[key] = pg


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def construct(name: str, pg_key: str, ranks: list[int], dims: ParallelDims, cls: type, args: tuple,
              kwargs: dict) -> Any:
    """Build the worker with its context (the group's ``dims`` included) set; returns an RRef, or a `Failure`."""
    ctx = WorkerContext(name, list(ranks), dist.get_rank(), _process_groups[pg_key], _device(), dims)

    def build() -> Worker:
        set_current_context(ctx)  # thread-local: set on the thread that constructs
        try:
            return cls(*args, **kwargs)
        finally:
            set_current_context(None)

    try:
        worker = compute_thread.run(build)
    except Exception:
        return Failure(traceback.format_exc())
    if not isinstance(getattr(worker, "context", None), WorkerContext):
        return Failure(f"{cls.__name__}.__init__ did not call super().__init__()")
    _workers[name] = worker
    return rpc.RRef(worker)


def invoke(name: str, method: str, args: tuple, kwargs: dict, want_result: bool) -> Any:
    """Every call: run the worker method (on the compute thread when it is free); errors come back as `Failure`."""
    return compute_thread.run(lambda: _run_method(name, method, args, kwargs, want_result))


def _run_method(name: str, method: str, args: tuple, kwargs: dict, want_result: bool) -> Any:
    stall.enter(name, method)
    try:
        out = profiling.record(name, method, lambda: getattr(_workers[name], method)(*args, **kwargs))
    except Exception:
        return Failure(traceback.format_exc())
    finally:
        stall.leave()
    return out if want_result else None
