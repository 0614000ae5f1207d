"""`WorkerGroup`: one Worker class on a set of ranks, driven from the controller.

Construction (controller side, collective over the whole world):
1. every world rank is asked over RPC to call ``dist.new_group(ranks)``; the
   controller creates groups one at a time and waits for all ranks, so every
   rank creates the same groups in the same order;
2. every rank of the group constructs the worker with its `WorkerContext` set
   (one RPC per rank); the worker is kept in a per-process registry and an RRef
   to it is returned to the controller (``group.rrefs``);
3. the controller reads each worker's ``dp_rank``/``dp_size`` and tells the
   first rank of each data-parallel group that it is the DP leader.

Calls: ``group.method(*args, **kwargs)`` sends exactly one RPC per rank of the
group (to a module-level function that looks the worker up by group name) and
gathers the answers as the method's `Dispatch` mode says.
``group.method.async_(...)`` returns a `GroupFuture` instead of waiting; so
does a plain call of a method registered with ``blocking=False``.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import traceback
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from torchrlhf.data.batch import Batch
from torchrlhf.runtime import compute_thread, stall
from torchrlhf.runtime.mesh import forget_meshes
from torchrlhf.runtime.launch import (
    _on_finish,
    is_initialized,
    is_reachable,
    lost_ranks,
    mark_lost,
    rpc_timeout,
    worker_name,
)
from torchrlhf.runtime.worker import Dispatch, Worker, WorkerContext, registered_methods, set_current_context

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------- worker side (runs on every rank)
_process_groups: dict[str, dist.ProcessGroup | None] = {}
_workers: dict[str, Worker] = {}


class _Failure:
    """What a worker sends back instead of raising: the formatted remote traceback."""

    def __init__(self, text: str) -> None:
        self.text = text


def _new_group(key: str, ranks: list[int]) -> None:
    """RPC target on every live world rank: create the group's process group (collective)."""
    pg = dist.new_group(ranks)
    if dist.get_rank() in ranks:
        _process_groups[key] = pg


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _construct(name: str, pg_key: str, ranks: list[int], cls: type, args: tuple, kwargs: dict) -> Any:
    """RPC target: build the worker with its context set; returns an RRef, or a `_Failure`."""
    ctx = WorkerContext(name, list(ranks), dist.get_rank(), _process_groups[pg_key], _device())

    def build() -> Worker:
        set_current_context(ctx)  # thread-local: set on the thread that constructs
        try:
            return cls(*args, **kwargs)
        finally:
            set_current_context(None)

    try:
        worker = compute_thread.run(build)
    except Exception:
        return _Failure(traceback.format_exc())
    if not isinstance(getattr(worker, "context", None), WorkerContext):
        return _Failure(f"{cls.__name__}.__init__ did not call super().__init__()")
    _workers[name] = worker
    return rpc.RRef(worker)


def _placement(name: str) -> tuple[int, int]:
    w = _workers[name]
    return int(w.dp_rank), int(w.dp_size)


def _set_leader(name: str, leader: bool) -> None:
    _workers[name]._is_dp_leader = leader


def _invoke(name: str, method: str, args: tuple, kwargs: dict, want_result: bool) -> Any:
    """RPC target of every call: run the worker method (on the compute thread when it is free)."""
    return compute_thread.run(lambda: _run_method(name, method, args, kwargs, want_result))


def _run_method(name: str, method: str, args: tuple, kwargs: dict, want_result: bool) -> Any:
    """Run the worker method; errors come back as `_Failure`."""
    stall.enter(name, method)
    try:
        out = getattr(_workers[name], method)(*args, **kwargs)
    except Exception:
        return _Failure(traceback.format_exc())
    finally:
        stall.leave()
    return out if want_result else None


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


# ---------------------------------------------------------------------- controller side
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


_names: set[str] = set()
_counter = itertools.count()
_create_lock = threading.Lock()


def _reset() -> None:
    """At runtime shutdown, before the process group goes: close every worker of this process, then forget them."""
    for worker in reversed(list(_workers.values())):  # the reverse of construction: users before what they use
        worker.close()
    _workers.clear()
    stall.forget_busy()
    _process_groups.clear()
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
        futs = [rpc.rpc_async(worker_name(r), _new_group, args=(key, ranks)) for r in callers]
        for f in futs:
            f.wait()


def new_process_group(key: str, ranks: Sequence[int]) -> None:
    """Controller side: a process group over ``ranks`` (e.g. across two roles' groups, for weight sync).

    Every world rank takes part in the creation (but the ranks given up with `launch.mark_lost`); members
    find it with `process_group(key)`.
    """
    ranks = _check_ranks(ranks)
    if key in _names:
        raise ValueError(f"process group key {key!r} is already in use")
    _names.add(key)
    _create_process_group(key, ranks)


class GroupFuture:
    """The pending answers of one group call; `wait()` returns the collected result.

    Fails fast: the first failed rank raises `WorkerError` without waiting for
    the others (which may be stuck in a collective with the failed rank).
    """

    def __init__(self, group: str, method: str, ranks: list[int], futs: list, collect: Callable[[list], Any]):
        self._group, self._method, self._ranks, self._collect = group, method, ranks, collect
        self._results: list[Any] = [None] * len(futs)
        self._error: WorkerError | None = None
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
                self._group, self._method, rank,
                f"rank {rank} did not answer (its process died, or the call timed out): {e}", unreachable=True,
            )
        if isinstance(value, _Failure):
            err = WorkerError(self._group, self._method, rank, value.text)
        with self._lock:
            self._results[i] = value
            self._pending -= 1
            if err is not None and self._error is None:
                self._error = err
            if self._error is not None or self._pending == 0:
                self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """The collected answer. Without ``timeout``, a call running past the stall timeout raises
        `StallError` with every rank's status (`runtime.stall`)."""
        limit = stall.stall_timeout() if timeout is None else None
        if limit is not None:
            if not self._event.wait(limit):
                raise stall.StallError(stall.report(f"{self._group}.{self._method}", limit))
        elif not self._event.wait(timeout):
            raise TimeoutError(f"{self._group}.{self._method} did not finish in {timeout}s")
        if self._error is not None:
            raise self._error
        return self._collect(self._results)


def wait_all(*futures: GroupFuture, poll_s: float = 0.05) -> list[Any]:
    """Wait for several group calls that depend on each other (two halves of one collective).

    Raises the first failure as soon as it happens: the other call may never finish once its peer died;
    past the stall timeout, `StallError` with every rank's status.
    """
    start, limit = time.perf_counter(), stall.stall_timeout()
    while not all(f.done() for f in futures):
        failed = next((f for f in futures if f.done() and f._error is not None), None)
        if failed is not None:
            failed.wait()
        if limit is not None and time.perf_counter() - start > limit:
            pending = next(f for f in futures if not f.done())
            raise stall.StallError(stall.report(f"{pending._group}.{pending._method}", limit))
        time.sleep(poll_s)
    return [f.wait() for f in futures]


def _mean_metrics(answers: list[Mapping[str, Any]]) -> dict[str, float]:
    keys = set(answers[0])
    for a in answers[1:]:
        if set(a) != keys:
            raise ValueError(f"metric dicts of the DP ranks disagree on keys: {sorted(keys)} vs {sorted(a)}")
    return {k: sum(float(a[k]) for a in answers) / len(answers) for k in answers[0]}


def _default_dp_collect(answers: list[Any]) -> Any:
    if all(a is None for a in answers):
        return None
    if all(isinstance(a, Batch) for a in answers):
        return Batch.concat(answers)
    if all(isinstance(a, Mapping) for a in answers):
        return _mean_metrics(answers)
    return answers


_NAMED_COLLECTS: dict[str, Callable[[list], Any]] = {
    "concat": Batch.concat,
    "mean": _mean_metrics,
    "list": list,
    "first": lambda answers: answers[0],
}


class _GroupMethod:
    """A registered worker method as seen from the controller."""

    def __init__(self, group: WorkerGroup, name: str, opts: dict[str, Any]) -> None:
        self._group, self._name = group, name
        self.dispatch: Dispatch = opts["dispatch"]
        self.blocking: bool = opts["blocking"]
        collect = opts["collect"]
        if isinstance(collect, str):
            if collect not in _NAMED_COLLECTS:
                raise ValueError(f"{name}: unknown collect {collect!r}; valid: {sorted(_NAMED_COLLECTS)}")
            collect = _NAMED_COLLECTS[collect]
        self.collect: Callable[[list], Any] | None = collect

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
    ) -> None:
        name = name or f"{getattr(worker_cls, '__name__', 'group')}_{next(_counter)}"
        _check_worker_cls(worker_cls, name)
        ranks = _check_ranks(ranks)
        _reserve([name])
        try:
            _create_process_group(name, ranks)
            self._build(worker_cls, ranks, name, name, tuple(args), dict(kwargs or {}), timeout)
        except BaseException:
            _names.discard(name)
            raise

    @classmethod
    def _on_process_group(
        cls, worker_cls: type[Worker], ranks: list[int], name: str, pg_key: str,
        args: tuple, kwargs: dict, timeout: float | None,
    ) -> WorkerGroup:
        self = cls.__new__(cls)
        self._build(worker_cls, ranks, name, pg_key, args, kwargs, timeout)
        return self

    def _build(
        self, worker_cls: type[Worker], ranks: list[int], name: str, pg_key: str,
        args: tuple, kwargs: dict, timeout: float | None,
    ) -> None:
        self.worker_cls, self.ranks, self.name = worker_cls, ranks, name
        self.timeout = rpc_timeout() if timeout is None else timeout
        self._workers = [rpc.get_worker_info(worker_name(r)) for r in ranks]
        self._methods = {k: _GroupMethod(self, k, v) for k, v in registered_methods(worker_cls).items()}
        answers = self._fan_out("__init__", _construct, [(name, pg_key, ranks, worker_cls, args, kwargs)] * len(ranks))
        self.rrefs: list[rpc.RRef] = answers
        placement = self._fan_out("dp_placement", _placement, [(name,)] * len(ranks))
        sizes = {s for _, s in placement}
        dp_ranks = [r for r, _ in placement]
        if len(sizes) != 1 or sorted(set(dp_ranks)) != list(range(next(iter(sizes)))):
            raise ValueError(
                f"group {name!r}: workers declare inconsistent dp_rank/dp_size {placement}; every dp_rank in "
                "0..dp_size-1 must be taken by at least one rank and all ranks must agree on dp_size"
            )
        self.dp_size = sizes.pop()
        self.dp_ranks = dp_ranks
        self.lost_dp_ranks: set[int] = set()  # replicas given up (`drop_replica`); calls skip their ranks
        self._lost_lock = threading.Lock()
        self._leaders = [dp_ranks.index(d) for d in range(self.dp_size)]  # group rank answering for each DP group
        self._fan_out("dp_placement", _set_leader, [(name, i in self._leaders) for i in range(len(ranks))])

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
        msg = f"torchrlhf: LOST group {self.name!r} replica {dp_rank} (ranks {dropped}): {why}; going on with " \
              f"replicas {self.live_dp_ranks}"
        log.error(msg)
        return dropped

    def _unreachable_ranks(self) -> list[int]:
        return [r for r in self.live_ranks if not is_reachable(r)]

    def unreachable_replicas(self) -> list[int]:
        """Live replicas with a rank that no longer answers RPC (its process died)."""
        return sorted({self.replica_of(r) for r in self._unreachable_ranks()})

    def drop_dead(self, called: Sequence[int]) -> bool:
        """After a call to ``called`` (global ranks) failed: `drop_replica` every live replica whose rank no
        longer answers; True if a rank of ``called`` is now lost (dropped here or by another thread), i.e.
        the call may go again to the live replicas."""
        dead = self._unreachable_ranks()  # each live rank asked once
        for d in sorted({self.replica_of(r) for r in dead}):
            self.drop_replica(d, dead)
        return bool(set(called) - set(self.live_ranks))

    def _call(self, m: _GroupMethod, args: tuple, kwargs: dict) -> GroupFuture:
        live = [i for i, d in enumerate(self.dp_ranks) if d not in self.lost_dp_ranks]  # group indices called
        n = len(live)
        where = f"{self.name}.{m._name}"
        if m.dispatch is Dispatch.ONE_TO_ALL:
            per_rank = [(args, kwargs, True)] * n
            collect = m.collect or list
        elif m.dispatch is Dispatch.RANK_ZERO:
            per_rank = [(args, kwargs, k == 0) for k in range(n)]
            collect = m.collect or (lambda answers: answers[0])
        elif m.dispatch is Dispatch.ALL_TO_ALL:
            if self.lost_dp_ranks:
                raise RuntimeError(f"{where}: ALL_TO_ALL needs every rank; replicas {sorted(self.lost_dp_ranks)} "
                                   "of this group are lost")
            per_rank = _split_all_to_all(where, args, kwargs, n)
            collect = m.collect or list
        elif m.dispatch is Dispatch.DP_COMPUTE:
            per_rank, collect = self._split_dp(where, m, args, kwargs, live)
        else:
            raise ValueError(f"{where}: unknown dispatch {m.dispatch!r}")
        futs = [
            rpc.rpc_async(self._workers[i], _invoke, args=(self.name, m._name, a, kw, want), timeout=self.timeout)
            for i, (a, kw, want) in zip(live, per_rank)
        ]
        return GroupFuture(self.name, m._name, [self.ranks[i] for i in live], futs, collect)

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
            rpc.rpc_async(self._workers[i], _invoke, args=(self.name, method, args, kwargs, i == leader),
                          timeout=self.timeout)
            for i in members
        ]
        pos = members.index(leader)
        return GroupFuture(self.name, method, [self.ranks[i] for i in members], futs, lambda answers: answers[pos])

    def _split_dp(self, where: str, m: _GroupMethod, args: tuple, kwargs: dict, live: list[int]):
        """One shard per live replica; ``live``: the group indices called (all ranks unless replicas were lost)."""
        for i, a in enumerate(args):
            if not isinstance(a, Batch):
                raise TypeError(
                    f"{where} (DP_COMPUTE): positional argument {i} must be a Batch, got {type(a).__name__}"
                )
        batches = {**{i: a for i, a in enumerate(args)}, **{k: v for k, v in kwargs.items() if isinstance(v, Batch)}}
        if not batches:
            raise TypeError(f"{where} (DP_COMPUTE) needs at least one Batch argument")
        sizes = {k: len(b) for k, b in batches.items()}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"{where} (DP_COMPUTE): Batch arguments differ in size: {sizes}")
        total = next(iter(sizes.values()))
        if total == 0:
            raise ValueError(f"{where} (DP_COMPUTE): got an empty Batch")
        replicas = self.live_dp_ranks
        dp = len(replicas)
        slot = {d: j for j, d in enumerate(replicas)}
        shards = {}
        for k, b in batches.items():
            padded, _ = b.pad_to_multiple(dp)
            shards[k] = padded.chunk(dp)
        shard_size = -(-total // dp)
        real = [max(0, min(shard_size, total - j * shard_size)) for j in range(dp)]  # non-padding rows per shard
        per_rank = []
        for i in live:
            j = slot[self.dp_ranks[i]]
            a = tuple(shards[x][j] for x in range(len(args)))
            kw = {k: (shards[k][j] if k in shards else v) for k, v in kwargs.items()}
            per_rank.append((a, kw, i in self._leaders))
        leaders = [live.index(self._leaders[d]) for d in replicas]  # answer positions of the replicas' leaders

        def collect(results: list[Any]) -> Any:
            answers = [_strip_padding(results[leaders[j]], real[j], shard_size) for j in range(dp)]
            if m.collect is not None:
                return m.collect(answers)
            if all(isinstance(a, Mapping) for a in answers):  # metrics of all-padding shards do not count
                answers = [a for a, r in zip(answers, real) if r > 0]
            return _default_dp_collect(answers)

        return per_rank, collect

    def __repr__(self) -> str:
        cls = self.worker_cls.__name__
        return f"WorkerGroup({cls}, name={self.name!r}, ranks={self.ranks}, dp_size={self.dp_size})"


def _strip_padding(answer: Any, real: int, shard_size: int) -> Any:
    """Drop the rows that came from padding samples (answers may hold k rows per input sample)."""
    if not isinstance(answer, Batch) or real == shard_size:
        return answer
    if len(answer) % shard_size:
        raise ValueError(
            f"cannot strip DP padding: a shard of {shard_size} samples returned a Batch of {len(answer)} rows"
        )
    return answer[: real * (len(answer) // shard_size)]


def _split_all_to_all(where: str, args: tuple, kwargs: dict, n: int) -> list[tuple]:
    for key, v in [*enumerate(args), *kwargs.items()]:
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{where} (ALL_TO_ALL): argument {key!r} must be a list with one entry per rank")
        if len(v) != n:
            raise ValueError(f"{where} (ALL_TO_ALL): argument {key!r} has {len(v)} entries, the group has {n} ranks")
    return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}, True) for i in range(n)]


def colocate(
    roles: Mapping[str, tuple],
    ranks: Sequence[int] | None = None,
    *,
    timeout: float | None = None,
) -> dict[str, WorkerGroup]:
    """Build several roles in the same processes on ``ranks``; returns name -> handle.

    ``roles`` maps a unique group name to ``(worker_cls,)``, ``(worker_cls, args)``
    or ``(worker_cls, args, kwargs)``. The roles share each rank's process (so
    its device and memory) and one process group over ``ranks``; each gets its
    own handle and its own DP placement.
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
        return {
            role: WorkerGroup._on_process_group(cls, ranks, role, pg_key, args, kwargs, timeout)
            for role, (cls, args, kwargs) in specs.items()
        }
    except BaseException:
        _names.difference_update(specs)
        raise
