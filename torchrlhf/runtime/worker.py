"""The `Worker` base class and the `register` decorator.

A Worker is code that lives on one rank. A `WorkerGroup` (see `group.py`)
constructs one instance per rank of the group, SPMD; the controller calls the
worker's `@register`-ed methods and the runtime splits inputs and collects
outputs as the method's `Dispatch` mode says.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchrlhf.runtime import profiling, stall
from torchrlhf.runtime.parallel_dims import ParallelDims


class Dispatch(enum.Enum):
    """How the controller fans a call out to a group and gathers the answers."""

    ONE_TO_ALL = "one_to_all"  # same args to every rank; list of results, one per rank
    DP_COMPUTE = "dp_compute"  # Batch args split by data-parallel rank; results concatenated
    RANK_ZERO = "rank_zero"  # every rank runs it (SPMD); the group's rank 0 result is returned
    ALL_TO_ALL = "all_to_all"  # caller passes one list entry per rank; list of results


@dataclass
class WorkerContext:
    """Where a worker lives: set by the runtime before the worker's __init__ runs."""

    group_name: str
    ranks: list[int]  # global ranks of the group, in group order
    rank: int  # this process's global rank
    process_group: dist.ProcessGroup | None  # the group's own process group (None: single process)
    device: torch.device
    parallel_dims: ParallelDims | None = None  # the group's layout (None: the worker builds its own)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def group_rank(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def group_size(self) -> int:
        return len(self.ranks)


_current = threading.local()


def set_current_context(ctx: WorkerContext | None) -> None:
    """Runtime-only: the context the next Worker constructed on this thread picks up."""
    _current.ctx = ctx


def _default_context() -> WorkerContext:
    """A one-rank context for notebooks and unit tests: the whole (possibly 1-rank) world."""
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        ranks = list(range(dist.get_world_size()))
        pg = dist.group.WORLD
    else:
        rank, ranks, pg = 0, [0], None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return WorkerContext("local", ranks, rank, pg, device)


REGISTER_ATTR = "_torchrlhf_dispatch"


def register(dispatch: Dispatch = Dispatch.ONE_TO_ALL, collect: str | Callable | None = None, blocking: bool = True):
    """Mark a Worker method as callable from the controller.

    Args:
        dispatch: how arguments are split across the group's ranks.
        collect: how answers are combined; ``None`` picks the dispatch's default
            (DP_COMPUTE: concatenate Batches / average metric dicts; RANK_ZERO:
            the first answer; ONE_TO_ALL and ALL_TO_ALL: the list of answers).
            A callable receives the list of answers, one per data-parallel group
            for DP_COMPUTE, one per rank otherwise.
        blocking: default of the controller-side call; ``False`` returns a future.
    """

    def decorate(fn: Callable) -> Callable:
        setattr(fn, REGISTER_ATTR, {"dispatch": dispatch, "collect": collect, "blocking": blocking})
        return fn

    return decorate


class Worker:
    """Base of every role (actor, critic, reward model, ...).

    Subclasses call ``super().__init__()`` first; after that ``self.rank``,
    ``self.ranks``, ``self.group_rank``, ``self.group_size``,
    ``self.process_group`` and ``self.device`` describe where the worker runs,
    and ``self.parallel_dims`` how the group's ranks divide into data-parallel
    replicas of tensor-parallel ranks (`ParallelDims`): all TP ranks of one
    replica share a ``dp_rank``, so `Dispatch.DP_COMPUTE` sends them the same
    shard and collects one answer per replica. The layout is the group's, given
    by the controller (`WorkerGroup`'s ``parallel_dims``); a worker built outside
    a group lays its context's ranks out with ``tp`` adjacent ranks per replica.
    """

    def __init__(self, *, tp: int = 1, ep: int = 1) -> None:
        ctx = getattr(_current, "ctx", None) or _default_context()
        self.context = ctx
        self.parallel_dims = ctx.parallel_dims or ParallelDims(ctx.group_size, tp=tp, ep=ep)

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def ranks(self) -> list[int]:
        return self.context.ranks

    @property
    def group_rank(self) -> int:
        return self.context.group_rank

    @property
    def group_size(self) -> int:
        return self.context.group_size

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        return self.context.process_group

    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def dp_rank(self) -> int:
        return self.parallel_dims.dp_rank(self.group_rank)

    @property
    def dp_size(self) -> int:
        return self.parallel_dims.dp

    @property
    def tp_rank(self) -> int:
        return self.parallel_dims.tp_rank(self.group_rank)

    def close(self) -> None:
        """Release what outlives the Python object (child processes, ...): called once at runtime shutdown."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def busy_seconds(self) -> tuple[float, dict[str, float]]:
        """This rank's clock and the seconds it has spent inside each method (`runtime.stall.busy_seconds`)."""
        return stall.busy_seconds(self.context.group_name)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def start_profile(self, step: int, out_dir: str) -> None:
        """Record each of this worker's calls with torch.profiler, in the thread that runs it, until
        `stop_profile` (`runtime.profiling`)."""
        profiling.start(self.context.group_name, self.rank, step, out_dir)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def stop_profile(self) -> list[str]:
        """Write the recorded calls' trace and key-averages table; returns their paths on this rank."""
        return profiling.stop(self.context.group_name)

    def build_meshes(self) -> tuple[DeviceMesh, DeviceMesh | None]:
        """(dp_mesh, tp_mesh) of ``self.parallel_dims`` over this group's ranks (tp_mesh None without TP).

        Collective over the group the first time (every rank of the group calls it, in the same order
        relative to other mesh creations); made by the one mesh factory and cached: a 1-D mesh reuses the
        group's process group, a 2-D one creates one subgroup per dimension that only the group's ranks
        take part in.
        """
        if self.process_group is None:
            raise RuntimeError("a device mesh needs torch.distributed (run under the runtime)")
        return self.parallel_dims.build_meshes(self.ranks, self.device.type, self.process_group)

    def build_expert_mesh(self) -> DeviceMesh | None:
        """``parallel_dims``' expert mesh over this group's ranks (None without expert parallelism)."""
        return self.parallel_dims.build_expert_mesh(self.ranks, self.device.type, self.process_group)


def registered_methods(cls: type) -> dict[str, dict[str, Any]]:
    """name -> register options of every `@register`-ed method of ``cls`` (inherited ones too)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dir(cls):
        fn = getattr(cls, name, None)
        opts = getattr(fn, REGISTER_ATTR, None)
        if opts is not None:
            out[name] = opts
    return out

