"""Single-process tests of the Worker contract, register and the address helper."""

from __future__ import annotations

import socket

import pytest
import torch

from torchrlhf.runtime import Dispatch, Worker, WorkerContext, register
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
    assert set(methods) == {"step", "ping", "busy_seconds"}  # every Worker reports its busy time
    assert methods["step"] == {"dispatch": Dispatch.DP_COMPUTE, "collect": "mean", "blocking": False}
    assert methods["ping"]["dispatch"] is Dispatch.ONE_TO_ALL and methods["ping"]["blocking"] is True
    assert Child().ping() == "pong"  # still a plain method locally


def test_default_context_outside_the_runtime() -> None:
    w = Child()
    assert (w.rank, w.ranks, w.group_rank, w.group_size) == (0, [0], 0, 1)
    assert w.process_group is None and w.device == torch.device("cpu")
    assert (w.dp_rank, w.dp_size, w.is_dp_leader) == (0, 1, True)
    with pytest.raises(RuntimeError, match="torch.distributed"):
        w.device_mesh()


def test_context_set_by_the_runtime_is_used_once() -> None:
    ctx = WorkerContext("g", [3, 5, 7], 5, None, torch.device("cpu"))
    set_current_context(ctx)
    try:
        w = Child()
    finally:
        set_current_context(None)
    assert (w.rank, w.ranks, w.group_rank, w.group_size, w.dp_rank, w.dp_size) == (5, [3, 5, 7], 1, 3, 1, 3)
    with pytest.raises(ValueError, match="does not hold"):
        w.device_mesh((2, 2), ("dp", "tp"))
    with pytest.raises(ValueError, match="names"):
        w.device_mesh((3,), ("a", "b"))
    assert Child().rank == 0


def test_interface_for_loopback() -> None:
    assert interface_for("127.0.0.1") == "lo"
    assert interface_for("localhost") == "lo"
    assert interface_for("no-such-host.invalid") is None
    assert socket.if_nameindex()  # the helper relies on Linux interface listing
