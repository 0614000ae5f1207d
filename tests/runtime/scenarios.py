"""Multi-process scenarios for test_runtime.py, run as ``torchrun ... scenarios.py NAME [ARGS]``.

Worker classes live here (this file is ``__main__`` on every rank, so RPC
can unpickle them everywhere). Each scenario asserts against hand-derived
values on the controller and prints ``PASS <what>``; any failure raises.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchrlhf.data import Batch
from torchrlhf.runtime import Dispatch, ParallelDims, Worker, WorkerError, WorkerGroup, colocate, launch, register

_shared: dict[str, object] = {}  # per-process: proves colocated roles share a process


class Probe(Worker):
    """A worker whose methods expose the dispatch machinery."""

    def __init__(self, scale: int = 10) -> None:
        super().__init__()
        self.scale = scale
        self.seen: list[str] = []

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> tuple:
        return self.rank, self.ranks, self.group_rank, self.group_size, self.dp_rank, self.dp_size, self.tp_rank

    @register(Dispatch.RANK_ZERO)
    def rank_zero(self, x: int) -> tuple:
        return self.group_rank, x

    @register(Dispatch.ALL_TO_ALL)
    def each(self, v: int, *, w: int = 0) -> int:
        return v + w + 100 * self.group_rank

    @register(Dispatch.DP_COMPUTE)
    def scaled(self, b: Batch, *, offset: int = 0) -> Batch:
        self.seen = list(b["id"])
        out = b.copy()
        out["y"] = b["x"] * self.scale + self.dp_rank + offset
        out["who"] = torch.full((len(b),), self.rank)
        return out

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def pair(self, a: Batch, *, b: Batch, tag: str) -> Batch:
        return Batch({"s": a["x"] + b["x"]}, {"tag": [tag] * len(a)})

    @register(Dispatch.DP_COMPUTE)
    def expand(self, b: Batch) -> Batch:
        return b.repeat(2, interleave=True)

    @register(Dispatch.DP_COMPUTE)
    def metrics(self, b: Batch) -> dict[str, float]:
        return {"n": float(len(b)), "d": float(self.dp_rank)}

    @register(Dispatch.DP_COMPUTE, collect=lambda answers: [len(a) for a in answers])
    def sizes(self, b: Batch) -> Batch:
        return b

    @register(Dispatch.ONE_TO_ALL)
    def seen_ids(self) -> list[str]:
        return self.seen

    @register(Dispatch.ONE_TO_ALL)
    def group_sum(self) -> float:
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t, group=self.process_group)
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"planned failure on rank {rank}")
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def survivors_sum(self) -> float:
        """All-reduce of rank + 1 over the "survivors" group (the controller, rank 0, joins from its thread)."""
        from torchrlhf.runtime import process_group

        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t, group=process_group("survivors"))
        return t.item()

    @register(Dispatch.ONE_TO_ALL)
    def nap(self, seconds: float) -> None:
        time.sleep(seconds)

    @register(Dispatch.ONE_TO_ALL)
    def die_on(self, rank: int) -> int:
        if self.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def meet(self, mine: str, theirs: str, timeout: float = 60.0) -> bool:
        """Write ``mine``, wait for ``theirs``: both groups must be running at once to succeed."""
        Path(mine + f".{self.rank}").touch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(Path(theirs).parent.glob(Path(theirs).name + ".*")):
                return True
            time.sleep(0.02)
        return False

    def not_registered(self) -> None:
        pass


class Broken(Worker):
    def __init__(self) -> None:
        super().__init__()
        raise RuntimeError(f"bad config on rank {self.rank}")


class NoSuper(Worker):
    def __init__(self) -> None:
        pass


class TensorParallelProbe(Probe):
    """Built with TP=2 (the group's ``parallel_dims``): consecutive group ranks form one tensor-parallel group,
    sharing a DP shard."""

    @register(Dispatch.ONE_TO_ALL)
    def mesh_sums(self) -> tuple[float, float, float]:
        dp_mesh, tp_mesh = self.build_meshes()
        out = []
        for mesh in (tp_mesh, dp_mesh):
            t = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(t, group=mesh.get_group())
            out.append(t.item())
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t, group=self.process_group)
        out.append(t.item())
        return tuple(out)


class Actor(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def put(self, value: str) -> tuple:
        _shared["actor"] = value
        return os.getpid(), id(self.process_group), str(self.device)


class Critic(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def get(self) -> tuple:
        return _shared.get("actor"), os.getpid(), id(self.process_group), str(self.device)


class Hang(Worker):
    """A planted hang: one rank sleeps instead of joining the all-reduce the others wait in."""

    @register(Dispatch.ONE_TO_ALL)
    def reduce_except_on(self, rank: int) -> float:
        if self.group_rank == rank:
            time.sleep(120)
            print(f"rank {rank} woke from its sleep", flush=True)  # never, when the stall report ends the job
        t = torch.ones(1)
        dist.all_reduce(t, group=self.process_group)
        return t.item()


def expect_error(exc_type: type, fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        return str(e)
    raise AssertionError(f"{fn} did not raise {exc_type.__name__}")


def dispatch_modes(world: int) -> None:
    g = WorkerGroup(Probe, name="probe", kwargs={"scale": 10})
    where = g.where()
    assert where == [(r, list(range(world)), r, world, r, world, 0) for r in range(world)], where
    assert g.rank_zero(7) == (0, 7)
    assert g.each(list(range(1, world + 1)), w=[10] * world) == [11, 112, 213, 314][:world]
    print("PASS one_to_all rank_zero all_to_all")

    # Uneven batches. world 4: 6 samples padded to 8, shards of 2, the last shard is all padding.
    # world 2: 5 samples padded to 6, shards of 3, the last shard holds one padding sample.
    n, want = {
        4: (6, dict(y=[1000, 1010, 1021, 1031, 1042, 1052], who=[0, 0, 1, 1, 2, 2],
                    seen=[["s0", "s1"], ["s2", "s3"], ["s4", "s5"], ["s0", "s1"]],
                    metrics={"n": 2.0, "d": 1.0}, sizes=[2, 2, 2, 0])),
        2: (5, dict(y=[1000, 1010, 1020, 1031, 1041], who=[0, 0, 0, 1, 1],
                    seen=[["s0", "s1", "s2"], ["s3", "s4", "s0"]],
                    metrics={"n": 3.0, "d": 0.5}, sizes=[3, 2])),
    }[world]
    b = Batch({"x": torch.arange(n)}, {"id": [f"s{i}" for i in range(n)]}, {"step": 3})
    out = g.scaled(b, offset=1000)
    assert out["y"].tolist() == want["y"], out["y"]
    assert out["id"] == b["id"] and out["who"].tolist() == want["who"] and out.meta == {"step": 3}
    assert g.seen_ids() == want["seen"]
    assert g.expand(b)["x"].tolist() == [i for i in range(n) for _ in range(2)]
    assert g.metrics(b) == want["metrics"]  # world 4: the all-padding shard of DP rank 3 does not count
    assert g.sizes(b) == want["sizes"]
    even = g.scaled(Batch({"x": torch.arange(4)}, {"id": list("abcd")}))
    assert even["y"].tolist() == {4: [0, 11, 22, 33], 2: [0, 10, 21, 31]}[world]
    print("PASS dp_compute uneven/expand/metrics/custom collect")

    pending = g.pair(b, b=b, tag="t")  # registered blocking=False: a plain call returns a future
    paired = pending.wait()
    assert paired["s"].tolist() == [2 * i for i in range(n)] and paired["tag"] == ["t"] * n
    assert "differ in size" in expect_error(ValueError, lambda: g.pair.async_(b, b=b[0:2], tag="t"))
    fut = g.rank_zero.async_(5)
    assert fut.wait() == (0, 5) and fut.done()
    assert g.group_sum() == [world * (world + 1) / 2] * world
    print("PASS async and world-group collective")

    assert "not @register-ed" in expect_error(TypeError, lambda: g.not_registered())
    expect_error(AttributeError, lambda: g.no_such_method)
    assert "must be a Batch" in expect_error(TypeError, g.scaled, {"x": torch.arange(3)})
    assert "one entry per rank" in expect_error(TypeError, g.each, 5)
    assert "has 3 entries" in expect_error(ValueError, g.each, [1, 2, 3])
    assert "outside the world" in expect_error(ValueError, WorkerGroup, Probe, [0, world])
    assert "unique" in expect_error(ValueError, WorkerGroup, Probe, None, "probe")
    assert "subclass" in expect_error(TypeError, WorkerGroup, object)
    msg = expect_error(WorkerError, WorkerGroup, Broken, None, "broken")
    assert "'broken'" in msg and "'__init__'" in msg and "RuntimeError: bad config on rank" in msg, msg
    assert "super().__init__()" in expect_error(WorkerError, WorkerGroup, NoSuper)
    print("PASS misuse errors")

    msg = expect_error(WorkerError, g.fail_on, world - 1)
    wanted = ["'probe'", "'fail_on'", f"rank {world - 1}", "Traceback", "ValueError: planned failure"]
    assert all(s in msg for s in wanted), msg
    assert [w[0] for w in g.where()] == list(range(world))  # the group survives a method error
    print("PASS worker error propagation")


def tensor_parallel() -> None:
    WorkerGroup(Probe, ranks=[1], name="lonely")  # rank 1 now holds one more process group than the others
    msg = expect_error(ValueError, WorkerGroup, TensorParallelProbe, [0, 1, 2], "odd",
                       parallel_dims=ParallelDims(4, tp=2))
    assert "lays out 4 ranks, got 3" in msg, msg  # on the controller, before any rank
    g = WorkerGroup(TensorParallelProbe, name="tp", parallel_dims=ParallelDims(4, tp=2))
    assert [w[4:] for w in g.where()] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    b = Batch({"x": torch.arange(3)}, {"id": ["a", "b", "c"]})
    out = g.scaled(b)  # 3 samples over 2 DP groups: shards [a b] and [c a(pad)]
    assert out["who"].tolist() == [0, 0, 2] and out["y"].tolist() == [0, 10, 21], out
    assert g.seen_ids() == [["a", "b"], ["a", "b"], ["c", "a"], ["c", "a"]]
    print("PASS tp routing")
    # mesh [[0,1],[2,3]]: tp groups {0,1},{2,3}; dp groups {0,2},{1,3}; values rank+1
    assert g.mesh_sums() == [(3.0, 4.0, 10.0), (3.0, 6.0, 10.0), (7.0, 4.0, 10.0), (7.0, 6.0, 10.0)]
    print("PASS device mesh")


def colocated(world: int) -> None:
    roles = colocate({"actor": (Actor,), "critic": (Critic, (), {})})
    put = roles["actor"].put("hello")
    got = roles["critic"].get()
    assert [g[0] for g in got] == ["hello"] * world
    assert [p[0:3] for p in put] == [g[1:4] for g in got]  # same pid, process group and device per rank
    assert len({p[0] for p in put}) == world
    assert "unique" in expect_error(ValueError, colocate, {"actor": (Actor,)})
    print("PASS colocation")


def split_placement(tmp: str) -> None:
    a = WorkerGroup(Probe, ranks=[0, 1], name="left")
    b = WorkerGroup(Probe, ranks=[2, 3], name="right")
    fa = a.meet.async_(f"{tmp}/left", f"{tmp}/right")
    fb = b.meet.async_(f"{tmp}/right", f"{tmp}/left")
    assert fa.wait() == [True, True] and fb.wait() == [True, True]
    assert a.group_sum() == [3.0, 3.0] and b.group_sum() == [7.0, 7.0]
    print("PASS split placement concurrency and per-group collectives")


def main_all(tmp: str) -> int:
    world = dist.get_world_size()
    dispatch_modes(world)
    if world == 4:
        tensor_parallel()
        split_placement(tmp)
    colocated(world)
    print("ALL PASSED")
    return 0


def main_error() -> None:
    slow = WorkerGroup(Probe, name="slow", timeout=1.0)
    msg = expect_error(WorkerError, slow.nap, 3.0)
    assert "'slow'" in msg and "'nap'" in msg and "did not answer" in msg, msg
    print("PASS call timeout", flush=True)
    g = WorkerGroup(Probe, name="doomed")
    g.fail_on(1)  # uncaught: the job must end non-zero on every rank


def main_kill() -> None:
    g = WorkerGroup(Probe, name="victim")
    try:
        g.die_on(1)
    except WorkerError as e:
        print(f"CAUGHT {e}", flush=True)
        raise


def main_lose() -> int:
    """Ranks 1 and 2 serve two replicas; rank 2 is killed. After `drop_replica` every dispatch mode uses
    rank 1 alone, a process group of the survivors works (rank 1 took part in a group rank 0 did not: the
case where members-only creation hangs), and the job ends cleanly."""
    from torchrlhf.runtime import new_process_group, process_group

    g = WorkerGroup(Probe, ranks=[1, 2], name="pair")
    try:
        g.die_on(2)
        raise AssertionError("die_on(2) returned")
    except WorkerError as e:
        assert e.unreachable and e.rank == 2, e
    assert g.unreachable_replicas() == [1]
    assert g.drop_replica(1) == [2] and g.drop_replica(1) == []  # once
    assert g.live_ranks == [1] and g.live_dp_ranks == [0]
    try:  # a call to the dropped replica fails like a call to a dead process
        g.call_dp(1, "where").wait()
        raise AssertionError("a call to a dropped replica returned")
    except WorkerError as e:
        assert e.unreachable and "replica 1 was dropped" in str(e), e
    assert g.where() == [(1, [1, 2], 0, 2, 0, 2, 0)]
    assert g.rank_zero(7) == (0, 7)
    out = g.scaled(Batch({"x": torch.arange(5.0)}, {"id": list("abcde")}), offset=1)
    assert torch.equal(out["y"], torch.arange(5.0) * 10 + 1) and out["who"].tolist() == [1] * 5
    assert g.seen_ids() == [list("abcde")]
    new_process_group("survivors", [0, 1])  # rank 2 cannot take part
    fut = g.survivors_sum.async_()
    mine = torch.tensor([1.0])  # rank 0's rank + 1
    dist.all_reduce(mine, group=process_group("survivors"))
    assert fut.wait() == [3.0] and mine.item() == 3.0
    print("PASS lost replica", flush=True)
    return 0


def main_stall() -> None:
    from torchrlhf.runtime import StallError, set_stall_timeout

    g = WorkerGroup(Hang, name="hang")
    set_stall_timeout(3.0)
    start = time.perf_counter()
    try:
        g.reduce_except_on(1)
    except StallError as e:
        print(f"REPORT after {time.perf_counter() - start:.1f} s\n{e}", flush=True)
        raise


if __name__ == "__main__":
    torch.set_num_threads(1)
    name = sys.argv[1]
    if name == "all":
        sys.exit(launch(main_all, sys.argv[2]))
    elif name == "error":
        launch(main_error, shutdown_timeout=5.0)
    elif name == "kill":
        launch(main_kill, shutdown_timeout=5.0)
    elif name == "lose":
        sys.exit(launch(main_lose, shutdown_timeout=5.0))
    elif name == "stall":
        launch(main_stall, shutdown_timeout=5.0)
    else:
        raise SystemExit(f"unknown scenario {name}")
