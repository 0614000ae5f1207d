"""The single-controller runtime: rank 0 drives SPMD worker groups over torch.distributed.rpc."""

from torchrlhf.runtime.futures import GroupFuture, WorkerError, wait_all
from torchrlhf.runtime.group import WorkerGroup, colocate, new_process_group
from torchrlhf.runtime.registry import local_worker, process_group
from torchrlhf.runtime.launch import exit_every_rank, init, launch, shutdown
from torchrlhf.runtime.parallel_dims import ParallelDims
from torchrlhf.runtime.stall import StallError, set_stall_timeout
from torchrlhf.runtime.worker import Dispatch, Worker, WorkerContext, register

__all__ = [
    "Dispatch",
    "GroupFuture",
    "ParallelDims",
    "StallError",
    "Worker",
    "WorkerContext",
    "WorkerError",
    "WorkerGroup",
    "colocate",
    "exit_every_rank",
    "init",
    "launch",
    "local_worker",
    "new_process_group",
    "process_group",
    "register",
    "set_stall_timeout",
    "shutdown",
    "wait_all",
]
