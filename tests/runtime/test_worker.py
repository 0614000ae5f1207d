"""Single-process tests of the Worker contract, register and the address helper."""

from __future__ import annotations

import socket

import pytest
import torch

from torchrlhf.runtime import Dispatch, ParallelDims, Worker, WorkerContext, register
from torchrlhf.runtime.launch import interface_for
from torchrlhf.runtime.worker import registered_methods, set_current_context


class Base(Worker):
    @register(Dispatch.DP_COMPUTE, collect="mean", blocking=False)
    def step(self, batch):
        return batch

    def helper(self):
        return 1


class Child(Base):
    @register()
    def ping(self):
        return "pong"


def test_registered_methods_include_inherited_and_options() -> None:
    methods = registered_methods(Child)
    # every Worker reports its busy time and records its calls of a profiled step (trainer.profile)
    assert set(methods) == {"step", "ping", "busy_seconds", "start_profile", "stop_profile"}
    assert methods["step"] == {"dispatch": Dispatch.DP_COMPUTE, "collect": "mean", "blocking": False}
    assert methods["ping"]["dispatch"] is Dispatch.ONE_TO_ALL and methods["ping"]["blocking"] is True
    assert Child().ping() == "pong"  # still a plain method locally


def test_default_context_outside_the_runtime() -> None:
    w = Child()
    assert (w.rank, w.ranks, w.group_rank, w.group_size) == (0, [0], 0, 1)
    assert w.process_group is None and w.device == torch.device("cpu")
    assert (w.dp_rank, w.dp_size, w.tp_rank, w.parallel_dims) == (0, 1, 0, ParallelDims(1))
    with pytest.raises(RuntimeError, match="torch.distributed"):
        w.build_meshes()


def test_context_set_by_the_runtime_is_used_once() -> None:
    ctx = WorkerContext("g", [3, 5, 7], 5, None, torch.device("cpu"))
    set_current_context(ctx)
    try:
        w = Child()
    finally:
        set_current_context(None)
    assert (w.rank, w.ranks, w.group_rank, w.group_size, w.dp_rank, w.dp_size) == (5, [3, 5, 7], 1, 3, 1, 3)
    assert Child().rank == 0


class Paired(Worker):
    """Two adjacent ranks per replica when built outside a group, from a constructor argument."""

    def __init__(self, tp: int = 2) -> None:
        super().__init__(tp=tp)


def test_the_groups_parallel_dims_are_used_and_a_lone_worker_builds_its_own() -> None:
    set_current_context(WorkerContext("g", [3, 5, 7, 9], 7, None, torch.device("cpu"), ParallelDims(4, tp=2)))
    try:
        w = Paired(tp=99)  # the group built the layout already (from the same arguments): it is not rebuilt
    finally:
        set_current_context(None)
    assert (w.dp_rank, w.tp_rank, w.dp_size) == (1, 0, 2)
    with pytest.raises(ValueError, match="tensor-parallel size 2 must divide the group's 1 ranks"):
        Paired()  # outside a group: its own layout, over the one-rank default context


def test_parallel_dims_arithmetic_and_errors() -> None:
    dims = ParallelDims(6, tp=3)
    assert dims.dp == 2
    assert [dims.coords(r) for r in range(6)] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert [dims.replica(d) for d in range(2)] == [[0, 1, 2], [3, 4, 5]]
    assert ParallelDims(4).dp == 4 and ParallelDims(4).coords(3) == (3, 0)
    with pytest.raises(ValueError, match="tensor-parallel size 4 must divide the group's 6 ranks"):
        ParallelDims(6, tp=4)
    for bad in (dict(world=0), dict(world=2, tp=0), dict(world=2.0), dict(world=True)):
        with pytest.raises(ValueError, match="must be a positive int"):
            ParallelDims(**bad)
    with pytest.raises(ValueError, match="outside the group's 6 ranks"):
        dims.coords(6)
    with pytest.raises(ValueError, match="outside the group's 2 data-parallel replicas"):
        dims.replica(2)
    with pytest.raises(ValueError, match="lays out 6 ranks, got 2"):
        dims.build_meshes([0, 1], "cpu")


def test_interface_for_loopback() -> None:
    assert interface_for("127.0.0.1") == "lo"
    assert interface_for("localhost") == "lo"
    assert interface_for("no-such-host.invalid") is None
    assert socket.if_nameindex()  # the helper relies on Linux interface listing
