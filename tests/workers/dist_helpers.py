"""Test helpers for the worker tests: start gloo ranks with a timeout, and build synthetic rollout batches."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchrlhf.data import Batch

import warm_processes  # a sibling, as this module is to its importers


# Ports for the stores the tests start themselves, below the kernel's ephemeral range (32768-60999 on Linux),
# where torchrun's own stores and every outgoing connection take theirs: a port picked by binding to 0 is free
# only until the process that asked binds it seconds later, and a torchrun started meanwhile by a parallel test
# could take it (seen once in CI: EADDRINUSE here, and the other run's store fed a stranger's bytes).
TEST_PORTS = range(20000, 32000)


def free_port(span: int = 1) -> int:
    """A port p with p .. p + span - 1 free now, drawn at random from `TEST_PORTS`."""
    rng = random.Random()  # not the tests' seeded global generator: parallel tests must draw differently
    for _ in range(200):
        port = rng.randrange(TEST_PORTS.start, TEST_PORTS.stop - span)
        try:
            with contextlib.ExitStack() as held:
                for p in range(port, port + span):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no {span} free consecutive ports in {TEST_PORTS}")


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    """Run ``fn`` on this rank, then leave together with the others and exit without finalisers.

    A rank that tears down while a peer still holds its gloo connections can abort in torch's C++ teardown
    (SIGABRT, "terminate called without an active exception"; seen once per few hundred runs in CI). By
    then ``fn`` has finished and written its results, so after a final barrier the rank skips interpreter
    finalisation. An exception in ``fn`` still propagates (the spawn wrapper reports it).
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 180.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; fail (never hang) past ``timeout``.

    The ranks fork from the warm forkserver (`warm_processes`), which has imported torch and torchrlhf once,
    and take the test's ``sys.path`` as spawned ones would."""
    warm_processes.start_server()
    ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=False,
                             start_method="forkserver")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish within {timeout}s")


def rollout_batch(num: int, prompt_len: int = 6, response_len: int = 5, vocab: int = 128, seed: int = 0,
                  temperature: float = 1.0, group_size: int = 1, min_response_len: int = 1) -> Batch:
    """Left-padded prompts + right-padded responses of varied lengths, with PPO columns filled in.

    Consecutive runs of ``group_size`` samples share one prompt (a GRPO group).
    """
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(num) // group_size
    p_lens = torch.randint(1, prompt_len + 1, (num,), generator=g)[group]
    r_lens = torch.randint(min_response_len, response_len + 1, (num,), generator=g)
    prompts = torch.randint(3, vocab, (num, prompt_len), generator=g)[group]
    responses = torch.randint(3, vocab, (num, response_len), generator=g)
    p_mask = (torch.arange(prompt_len) >= prompt_len - p_lens[:, None]).long()
    r_mask = (torch.arange(response_len) < r_lens[:, None]).long()
    prompts = torch.where(p_mask.bool(), prompts, 2)
    responses = torch.where(r_mask.bool(), responses, 2)
    attention_mask = torch.cat([p_mask, r_mask], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cols = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": r_mask,
        "old_log_probs": (-3.0 - torch.rand(num, response_len, generator=g)) * r_mask,
        "ref_log_prob": (-3.0 - torch.rand(num, response_len, generator=g)) * r_mask,
        "advantages": torch.randn(num, response_len, generator=g) * r_mask,
        "values": torch.randn(num, response_len, generator=g) * r_mask,
        "returns": torch.randn(num, response_len, generator=g) * r_mask,
    }
    return Batch(cols, meta={"temperature": temperature})


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded parameters (collective when the model is FSDP-sharded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=False))


def grouped(**kwargs) -> dict:
    """Worker keyword arguments written flat, with the optimizer keys (and ``grad_clip`` as ``clip_grad``) moved
    into ``optim``, the batch-size keys into ``batching``, the loss keys (``loss_agg_mode`` as ``agg_mode``)
    into ``loss``, the memory keys into ``memory`` and ``rollout_n`` / ``total_steps`` into ``run``: the
    sub-sections `ActorWorker` / `CriticWorker` take."""
    from torchrlhf.algorithms import PolicyLoss, ValueLoss
    from torchrlhf.utils.optim import SCHEDULE_KEYS
    from torchrlhf.workers import MemorySaving, TrainingRun
    from torchrlhf.workers.microbatch import Batching

    batch_keys = {f for f in Batching.__dataclass_fields__}
    loss_keys = {*PolicyLoss.__dataclass_fields__, *ValueLoss.__dataclass_fields__, "loss_agg_mode"}
    optim = {k: kwargs.pop(k) for k in [*kwargs] if k in ("lr", "weight_decay", "betas", *SCHEDULE_KEYS)}
    if "grad_clip" in kwargs:
        optim["clip_grad"] = kwargs.pop("grad_clip")
    batching = {k: kwargs.pop(k) for k in [*kwargs] if k in batch_keys}
    loss = {"agg_mode" if k == "loss_agg_mode" else k: kwargs.pop(k) for k in [*kwargs] if k in loss_keys}
    memory = {k: kwargs.pop(k) for k in [*kwargs] if k in MemorySaving.__dataclass_fields__}
    run = {k: kwargs.pop(k) for k in [*kwargs] if k in TrainingRun.__dataclass_fields__}
    return {**kwargs, "optim": optim, "batching": Batching(**batching), **({"loss": loss} if loss else {}),
            **({"memory": MemorySaving(**memory)} if memory else {}), **({"run": TrainingRun(**run)} if run else {})}
