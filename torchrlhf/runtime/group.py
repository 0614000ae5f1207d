"""`WorkerGroup`: one Worker class on a set of ranks, driven from the controller; `colocate` several on the same.

Construction (controller side, collective over the whole world):
1. every live world rank is asked over RPC to create the group's process group; the controller creates
   groups one at a time and waits for all ranks, so every rank creates the same groups in the same order;
2. every rank of the group constructs the worker with its `WorkerContext` set (one RPC per rank); the
   worker is kept in the rank's registry (`runtime.registry`) and an RRef returned (``group.rrefs``);
   the group's `ParallelDims` (given by the controller, which owns every role's layout) travels in that
   context, so workers and dispatch read one layout.

Calls: ``group.method(*args, **kwargs)`` sends exactly one RPC per rank of the group and gathers the
answers as the method's `Dispatch` mode says (`runtime.dispatch`). ``group.method.async_(...)`` returns a
`GroupFuture` instead of waiting; so does a plain call of a method registered with ``blocking=False``.
A replica whose rank died can be given up (`drop_replica`); calls then skip its ranks.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from torchrlhf.runtime import registry
from torchrlhf.runtime.dispatch import DISPATCH, NAMED_COLLECTS, CallLayout
from torchrlhf.runtime.futures import GroupFuture
from torchrlhf.runtime.launch import (
    _on_finish,
    is_initialized,
    is_reachable,
    lost_ranks,
    mark_lost,
    rpc_timeout,
    worker_name,
)
from torchrlhf.runtime.mesh import forget_meshes
from torchrlhf.runtime.parallel_dims import ParallelDims
from torchrlhf.runtime.worker import Dispatch, Worker, registered_methods

log = logging.getLogger(__name__)

_names: set[str] = set()
_counter = itertools.count()
_create_lock = threading.Lock()


def _reset() -> None:
    """At runtime shutdown, before the process group goes: close and forget every worker, group and name."""
    registry.forget_all()
    _names.clear()


_on_finish.append(_reset)
_on_finish.append(forget_meshes)


def _check_ranks(ranks: Sequence[int] | None) -> list[int]:
    if not is_initialized():
        raise RuntimeError("the runtime is not initialised: call torchrlhf.runtime.launch(main) or init() first")
    world = dist.get_world_size()
    if ranks is None:
        return list(range(world))
    ranks = list(ranks)
    if not ranks or not all(isinstance(r, int) for r in ranks):
        raise TypeError(f"ranks must be a non-empty list of ints, got {ranks!r}")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"ranks {bad} are outside the world of {world} ranks (0..{world - 1})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks contain duplicates: {ranks}")
    return ranks


def _check_worker_cls(cls: Any, name: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Worker)):
        raise TypeError(f"{name}: worker class must subclass torchrlhf.runtime.Worker, got {cls!r}")


def _reserve(names: Sequence[str]) -> None:
    clash = [n for n in names if n in _names]
    if clash or len(set(names)) != len(names):
        raise ValueError(f"worker group names must be unique; {clash or list(names)} already in use")
    _names.update(names)


def _create_process_group(key: str, ranks: list[int]) -> None:
    """Every live rank creates the group, members or not, in the same order: torch names such a group by how
    many were created before it, so a dead rank does not matter. (Members-only creation names a group by its
    ranks and the number of groups each member holds, which differ between roles: see `runtime.mesh`.)"""
    lost = lost_ranks()
    if lost & set(ranks):
        raise ValueError(f"process group {key!r}: ranks {sorted(lost & set(ranks))} are lost")
    with _create_lock:  # one group at a time: every rank sees the same creation order
        callers = [r for r in range(dist.get_world_size()) if r not in lost]  # the dead cannot take part
        futs = [rpc.rpc_async(worker_name(r), registry.new_group, args=(key, ranks)) for r in callers]
        for f in futs:
            f.wait()


def new_process_group(key: str, ranks: Sequence[int]) -> None:
    """Controller side: a process group over ``ranks`` (e.g. across two roles' groups, for weight sync).

    Every world rank takes part in the creation (but the ranks given up with `launch.mark_lost`); members
    find it with `registry.process_group(key)`.
    """
    ranks = _check_ranks(ranks)
    if key in _names:
        raise ValueError(f"process group key {key!r} is already in use")
    _names.add(key)
    _create_process_group(key, ranks)


class _GroupMethod:
    """A registered worker method as seen from the controller."""

    def __init__(self, group: WorkerGroup, name: str, opts: dict[str, Any]) -> None:
        self._group, self._name = group, name
        self.dispatch: Dispatch = opts["dispatch"]
        self.blocking: bool = opts["blocking"]
        collect = opts["collect"]
        if isinstance(collect, str):
            if collect not in NAMED_COLLECTS:
                raise ValueError(f"{name}: unknown collect {collect!r}; valid: {sorted(NAMED_COLLECTS)}")
            collect = NAMED_COLLECTS[collect]
        self.collect: Callable[[list], Any] = collect or DISPATCH[self.dispatch][1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fut = self.async_(*args, **kwargs)
        return fut.wait() if self.blocking else fut

    def async_(self, *args: Any, **kwargs: Any) -> GroupFuture:
        """Start the call on every rank of the group and return at once."""
        return self._group._call(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<{self._group.name}.{self._name} ({self.dispatch.name})>"


class WorkerGroup:
    """One ``worker_cls`` per rank of ``ranks``; registered methods are callable here.

    Args:
        worker_cls: a `Worker` subclass importable on every rank.
        ranks: global ranks (default: the whole world).
        name: unique group name (default: class name + counter).
        args, kwargs: constructor arguments, the same on every rank.
        timeout: per-call RPC timeout in seconds (default: the runtime's ``rpc_timeout``).
        process_group: the key of a process group over ``ranks`` to use (`colocate` shares one between
            roles); None creates the group's own.
        parallel_dims: how the ranks divide into data-parallel replicas of tensor-parallel ranks (the
            controller's layout of the role, `torchrlhf.trainer.schema.role_layouts`); None: every rank a replica.
    """

    def __init__(
        self,
        worker_cls: type[Worker],
        ranks: Sequence[int] | None = None,
        name: str | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
        process_group: str | None = None,
        parallel_dims: ParallelDims | None = None,
    ) -> None:
        name = name or f"{getattr(worker_cls, '__name__', 'group')}_{next(_counter)}"
        _check_worker_cls(worker_cls, name)
        ranks = _check_ranks(ranks)
        self.worker_cls, self.ranks, self.name = worker_cls, ranks, name
        self.timeout = rpc_timeout() if timeout is None else timeout
        self.parallel_dims = parallel_dims or ParallelDims(len(ranks))
        if self.parallel_dims.world != len(ranks):  # before any collective
            raise ValueError(f"group {name!r}: {self.parallel_dims} lays out {self.parallel_dims.world} ranks, "
                             f"got {len(ranks)}: {ranks}")
        self.dp_size = self.parallel_dims.dp
        self.dp_ranks = [self.parallel_dims.dp_rank(i) for i in range(len(ranks))]  # replica of each group rank
        self._leaders = [self.parallel_dims.replica(d)[0] for d in range(self.dp_size)]  # each replica's answer
        self.lost_dp_ranks: set[int] = set()  # replicas given up (`drop_replica`); calls skip their ranks
        self._lost_lock = threading.Lock()
        if process_group is None:
            _reserve([name])
        try:
            if process_group is None:
                process_group = name
                _create_process_group(name, ranks)
            self._workers = [rpc.get_worker_info(worker_name(r)) for r in ranks]
            self._methods = {k: _GroupMethod(self, k, v) for k, v in registered_methods(worker_cls).items()}
            self.rrefs: list[rpc.RRef] = self._fan_out(
                "__init__", registry.construct, [(name, process_group, ranks, self.parallel_dims, worker_cls,
                                                  tuple(args), dict(kwargs or {}))] * len(ranks))
        except BaseException:
            _names.discard(name)
            raise

    def _fan_out(self, method: str, fn: Callable, per_rank_args: list[tuple]) -> list[Any]:
        futs = [rpc.rpc_async(w, fn, args=a, timeout=self.timeout) for w, a in zip(self._workers, per_rank_args)]
        return GroupFuture(self.name, method, self.ranks, futs, list).wait()

    # ------------------------------------------------------------------ calls
    def __getattr__(self, item: str) -> _GroupMethod:
        methods = self.__dict__.get("_methods")
        if methods is None or item.startswith("__"):
            raise AttributeError(item)
        if item in methods:
            return methods[item]
        if hasattr(self.worker_cls, item):
            raise TypeError(
                f"{self.worker_cls.__name__}.{item} is not @register-ed, so group {self.name!r} cannot call it; "
                f"registered methods: {sorted(methods)}"
            )
        raise AttributeError(f"group {self.name!r} ({self.worker_cls.__name__}) has no method {item!r}; "
                             f"registered methods: {sorted(methods)}")

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *self._methods]

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def _call(self, m: _GroupMethod, args: tuple, kwargs: dict) -> GroupFuture:
        layout = CallLayout(called=[i for i, d in enumerate(self.dp_ranks) if d not in self.lost_dp_ranks],
                            replica_of=self.dp_ranks, leaders=self._leaders, live_replicas=self.live_dp_ranks)
        split, _ = DISPATCH[m.dispatch]
        per_rank, select = split(f"{self.name}.{m._name}", args, kwargs, layout)
        futs = [rpc.rpc_async(self._workers[i], registry.invoke, args=(self.name, m._name, a, kw, want),
                              timeout=self.timeout)
                for i, (a, kw, want) in zip(layout.called, per_rank)]
        return GroupFuture(self.name, m._name, [self.ranks[i] for i in layout.called], futs,
                           lambda results: m.collect(select(results)))

    def call_dp(self, dp_rank: int, method: str, *args: Any, **kwargs: Any) -> GroupFuture:
        """Start ``method`` on the ranks of one data-parallel group only (all its TP ranks, same arguments);
        the future answers what that group's leader returns. Lets the controller keep each rollout replica
        busy on its own (asynchronous training) instead of splitting one batch over all of them."""
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"{self.name}.call_dp: dp_rank {dp_rank} not in [0, {self.dp_size})")
        getattr(self, method)  # the usual error for an unknown or unregistered method
        members = [i for i, d in enumerate(self.dp_ranks) if d == dp_rank]
        if dp_rank in self.lost_dp_ranks:  # fails like a call to a dead process (it may have raced the drop)
            gone = torch.futures.Future()
            gone.set_exception(RuntimeError(f"replica {dp_rank} was dropped (`drop_replica`)"))
            return GroupFuture(self.name, method, [self.ranks[members[0]]], [gone], lambda answers: answers[0])
        leader = self._leaders[dp_rank]
        futs = [
            rpc.rpc_async(self._workers[i], registry.invoke, args=(self.name, method, args, kwargs, i == leader),
                          timeout=self.timeout)
            for i in members
        ]
        pos = members.index(leader)
        return GroupFuture(self.name, method, [self.ranks[i] for i in members], futs, lambda answers: answers[pos])

    # ------------------------------------------------------------------ lost replicas
    @property
    def live_dp_ranks(self) -> list[int]:
        """The data-parallel replicas still serving (all of them unless `drop_replica` gave some up)."""
        return [d for d in range(self.dp_size) if d not in self.lost_dp_ranks]

    @property
    def live_ranks(self) -> list[int]:
        return [r for r, d in zip(self.ranks, self.dp_ranks) if d not in self.lost_dp_ranks]

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica global ``rank`` belongs to."""
        return self.dp_ranks[self.ranks.index(rank)]

    def drop_replica(self, dp_rank: int, known_dead: Collection[int] | None = None) -> list[int]:
        """Give up replica ``dp_rank`` (a rank of it died): later calls go to the other replicas only, and the
        runtime's shutdown no longer waits for its dead ranks. Its ranks still alive (the TP peers of a dead
        rank, which cannot work alone) stay idle, and shut down with everyone else. ``known_dead``: ranks
        known not to answer (default: ask each rank of the replica). Returns the ranks given up (none if already)."""
        with self._lost_lock:
            if dp_rank in self.lost_dp_ranks:
                return []
            if len(self.lost_dp_ranks) + 1 == self.dp_size:
                raise RuntimeError(f"group {self.name!r}: its last live replica ({dp_rank}) is lost")
            self.lost_dp_ranks.add(dp_rank)
        dropped = [r for r, d in zip(self.ranks, self.dp_ranks) if d == dp_rank]
        if known_dead is None:
            known_dead = [r for r in dropped if not is_reachable(r)]
        dead = [r for r in dropped if r in known_dead]
        for r in dead:
            mark_lost(r)
        idle = sorted(set(dropped) - set(dead))
        why = ("its process no longer answers" if not idle else
               f"ranks {dead} no longer answer, ranks {idle} stay idle until shutdown")
        log.error(f"torchrlhf: LOST group {self.name!r} replica {dp_rank} (ranks {dropped}): {why}; going on with "
                  f"replicas {self.live_dp_ranks}")
        return dropped

    def unreachable_replicas(self) -> list[int]:
        """Live replicas with a rank that no longer answers RPC (its process died)."""
        return sorted({self.replica_of(r) for r in self.live_ranks if not is_reachable(r)})

    def drop_dead(self, called: Sequence[int]) -> bool:
        """After a call to ``called`` (global ranks) failed: `drop_replica` every live replica whose rank no
        longer answers; True if a rank of ``called`` is now lost (dropped here or by another thread), i.e.
        the call may go again to the live replicas."""
        dead = [r for r in self.live_ranks if not is_reachable(r)]  # each live rank asked once
        for d in sorted({self.replica_of(r) for r in dead}):
            self.drop_replica(d, dead)
        return bool(set(called) - set(self.live_ranks))

    def __repr__(self) -> str:
        cls = self.worker_cls.__name__
        return f"WorkerGroup({cls}, name={self.name!r}, ranks={self.ranks}, dp_size={self.dp_size})"


def colocate(
    roles: Mapping[str, tuple],
    ranks: Sequence[int] | None = None,
    *,
    timeout: float | None = None,
    parallel_dims: Mapping[str, ParallelDims] | None = None,
) -> dict[str, WorkerGroup]:
    """Build several roles in the same processes on ``ranks``; returns name -> handle.

    ``roles`` maps a unique group name to ``(worker_cls,)``, ``(worker_cls, args)``
    or ``(worker_cls, args, kwargs)``. The roles share each rank's process (so
    its device and memory) and one process group over ``ranks``; each gets its
    own handle and its own layout (``parallel_dims[role]``; every rank a replica
    for a role it does not name).
    """
    specs: dict[str, tuple[type, tuple, dict]] = {}
    for role, spec in roles.items():
        if not isinstance(spec, tuple) or not 1 <= len(spec) <= 3:
            raise TypeError(f"colocate: role {role!r} must be (worker_cls[, args[, kwargs]]), got {spec!r}")
        cls, args, kwargs = (*spec, (), {})[:3] if len(spec) == 1 else (*spec, {})[:3]
        _check_worker_cls(cls, role)
        specs[role] = (cls, tuple(args), dict(kwargs))
    if not specs:
        raise ValueError("colocate needs at least one role")
    ranks = _check_ranks(ranks)
    _reserve(list(specs))
    pg_key = "colocated:" + "+".join(specs)
    try:
        _create_process_group(pg_key, ranks)
        dims = dict(parallel_dims or {})
        return {role: WorkerGroup(cls, ranks, role, args, kwargs, timeout=timeout, process_group=pg_key,
                                  parallel_dims=dims.get(role))
                for role, (cls, args, kwargs) in specs.items()}
    except BaseException:
        _names.difference_update(specs)
        raise
