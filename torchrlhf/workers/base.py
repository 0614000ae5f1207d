"""What the FSDP2 training roles share: meshes, sharding, micro-batch loops, the optimizer step, checkpoints.

`ActorWorker`, `CriticWorker` and `RewardModelWorker` subclass `FSDPWorker`; it
owns nothing role-specific (no losses, no model heads).
"""

from __future__ import annotations

from pathlib import Path

import math
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchrlhf.data import Batch
from torchrlhf.models.parallelize import parallelize
from torchrlhf.runtime.worker import Dispatch, Worker, register
from torchrlhf.utils import checkpoint as ckpt
from torchrlhf.utils.optim import build_lr_scheduler, build_optimizer
from torchrlhf.workers.microbatch import micro_batch_groups, strided_mini_batches

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def total_grad_norm(params: list[torch.nn.Parameter]) -> float:
    """L2 norm of all gradients across every shard; NaN/inf when any gradient is.

    Gradients are grouped by device mesh (FSDP-only and FSDP×TP parameters may live
    on different meshes), each group's norm is made global with ``full_tensor``.
    """
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            by_mesh[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p.grad)
    sq = 0.0
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq += float(norm.double().item()) ** 2
    return math.sqrt(sq)


class FSDPWorker(Worker):
    """A worker whose model is FSDP2-sharded over its group (× TP when ``tp_size > 1``).

    Ranks of one TP group are adjacent in the worker group; they share a ``dp_rank``
    and receive the same data shard.
    """

    def __init__(self, *, tp_size: int = 1, seed: int = 0) -> None:
        super().__init__()
        if tp_size <= 0 or self.group_size % tp_size:
            raise ValueError(f"tp_size={tp_size} must be positive and divide the worker group size {self.group_size}")
        self.tp_size = tp_size
        self.dp_size = self.group_size // tp_size
        self.dp_rank = self.group_rank // tp_size
        self._is_dp_leader = self.group_rank % tp_size == 0
        self.dp_mesh, self.tp_mesh = self._build_meshes()
        self.dp_group = self.dp_mesh.get_group() if self.dp_mesh is not None else None
        self.seed = seed
        torch.manual_seed(seed)  # same on every rank: any random init must agree before FSDP shards it
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None

    # ------------------------------------------------------------------ setup
    def _build_meshes(self) -> tuple[DeviceMesh | None, DeviceMesh | None]:
        """(dp_mesh, tp_mesh) over this group's ranks only (TP groups are adjacent ranks); (None, None)
        without torch.distributed. Made by the one mesh factory (`Worker.device_mesh`)."""
        if self.process_group is None:
            if self.tp_size > 1:
                raise ValueError(f"tp_size={self.tp_size} needs torch.distributed (run under torchrun)")
            return None, None
        if self.tp_size == 1:
            return self.device_mesh((self.group_size,), ("dp",)), None
        mesh = self.device_mesh((self.dp_size, self.tp_size), ("dp", "tp"))
        return mesh["dp"], mesh["tp"]

    def _is_plain(self, dtype: torch.dtype, cpu_offload: bool) -> bool:
        """A one-rank fp32 group has nothing to shard, and FSDP2 there only adds DTensor dispatch and
        all-gather copies (~15-20% of a CPU update step). CPU offload and a lower compute dtype (FSDP2's
        mixed-precision policy, fp32 master weights) still need FSDP2."""
        return self.dp_mesh is None or (self.group_size == 1 and not cpu_offload and dtype == torch.float32)

    def loads_sharded(self, model_path: str, dtype: torch.dtype, cpu_offload: bool) -> bool:
        """Whether the model is built on the meta device and each rank reads only its shards: whenever it
        is FSDP2-sharded and the weights are a safetensors directory (a GGUF file loads whole)."""
        return not self._is_plain(dtype, cpu_offload) and Path(model_path).is_dir()

    def _build_model(
        self,
        model_path: str,
        dtype: torch.dtype,
        *,
        value_head: bool = False,
        freeze: bool = False,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        init_head_std: float | None = None,
    ) -> torch.nn.Module:
        """The role's model (a causal LM, or a `ValueModel` with ``value_head``), sharded over the group.

        When it is FSDP2-sharded and the weights are safetensors, it is built on the meta device and each
        rank reads only its own rows (`loads_sharded`); otherwise it is loaded whole, then sharded. A fresh
        value head is drawn from ``self.seed``, identical on every rank.
        """
        from torchrlhf.models import (
            build_meta_causal_lm,
            build_meta_value_model,
            load_causal_lm,
            load_value_model,
            load_value_weights,
        )
        from torchrlhf.models.sharded import load_weights

        sharded = self.loads_sharded(model_path, dtype, cpu_offload)
        if value_head:
            model = build_meta_value_model(model_path) if sharded else load_value_model(
                model_path, dtype=torch.float32, init_head_std=init_head_std, seed=self.seed)
        else:
            model = build_meta_causal_lm(model_path) if sharded else load_causal_lm(model_path, dtype=torch.float32)
            model.config.use_cache = False
        if freeze:
            model.requires_grad_(False)
        model = self._shard(model, dtype, activation_checkpointing and not freeze, cpu_offload)
        if sharded and value_head:
            load_value_weights(model, model_path, device=self.device, init_head_std=init_head_std, seed=self.seed,
                               cpu_offload=cpu_offload)
        elif sharded:
            load_weights(model, model_path, device=self.device, cpu_offload=cpu_offload)
        return model

    def _shard(self, model: torch.nn.Module, dtype: torch.dtype, activation_checkpointing: bool, cpu_offload: bool):
        """FSDP2 (× TP) over the group's ranks (a meta-device model stays on meta); the plain module when
        the group is one fp32 rank (see `_is_plain`)."""
        if self._is_plain(dtype, cpu_offload):
            if activation_checkpointing:
                from torchrlhf.models.parallelize import enable_activation_checkpointing

                enable_activation_checkpointing(model)
            return model.to(self.device)
        return parallelize(
            model,
            dp_mesh=self.dp_mesh,
            tp_mesh=self.tp_mesh,
            param_dtype=dtype,
            reduce_dtype=torch.float32,
            cpu_offload=cpu_offload,
            activation_checkpointing=activation_checkpointing,
        )

    def _init_optimizer(
        self,
        *,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        warmup_steps: int,
        total_steps: int | None,
        lr_scheduler: str,
        min_lr_ratio: float,
    ) -> None:
        self.optimizer = build_optimizer(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, warmup_steps=warmup_steps, total_steps=total_steps, style=lr_scheduler,
            min_lr_ratio=min_lr_ratio,
        )

    # ------------------------------------------------------------------ collectives
    def dp_sum(self, values: list[float]) -> list[float]:
        """Sum floats over the data-parallel group (identity on one rank)."""
        return self._dp_reduce(values, dist.ReduceOp.SUM)

    def dp_max(self, values: list[float]) -> list[float]:
        """Elementwise max of floats over the data-parallel group (identity on one rank)."""
        return self._dp_reduce(values, dist.ReduceOp.MAX)

    def _dp_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        if self.dp_group is None or self.dp_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.dp_group)
        return t.tolist()

    # ------------------------------------------------------------------ batching
    def check_local_batch(self, batch: Batch, *, ppo_mini_batch_size: int, rollout_n: int, role: str) -> int:
        """Number of mini-batches in this rank's shard; ValueError (quoting sizes) if it does not split."""
        per_rank = ppo_mini_batch_size * rollout_n // self.dp_size
        if len(batch) == 0 or len(batch) % per_rank:
            raise ValueError(
                f"{role}.update got {len(batch)} samples on data-parallel rank {self.dp_rank}/{self.dp_size}; "
                f"a mini-batch is {ppo_mini_batch_size} prompts x {rollout_n} responses / {self.dp_size} ranks = "
                f"{per_rank} samples per rank, which must divide it"
            )
        return len(batch) // per_rank

    def micro_batches(
        self, batch: Batch, *, micro_batch_size: int | None, max_tokens: int | None,
        lengths: list[int] | None = None,
    ) -> Iterator[tuple[Batch, torch.Tensor | None]]:
        """(micro-batch on this worker's device, its row indices in ``batch``) pairs.

        Every data-parallel rank gets the same count: a rank with fewer samples than its
        peers gets filler micro-batches (the first sample, index None) that it must run
        and discard, so collectives match. Batches travel between roles on the CPU; only
        the micro-batch being computed is on the accelerator. ``lengths`` (tokens each sample
        costs, for ``max_tokens``) default to the attended tokens.
        """
        if lengths is None:
            lengths = batch["attention_mask"].sum(-1).tolist()
        groups = micro_batch_groups(lengths, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                                    group=self.dp_group)
        for idx in groups:
            if idx:
                index = torch.tensor(idx)
                yield batch[index].to(self.device), index
            else:
                yield batch[0:1].to(self.device), None

    def map_micro_batches(
        self, batch: Batch, fn: Callable[[Batch, list[int]], dict[str, torch.Tensor]], *,
        micro_batch_size: int | None, max_tokens: int | None, lengths: list[int] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Apply ``fn(micro_batch, its row indices in batch)`` per micro-batch (no grad) and reassemble
        its outputs, on the CPU, in the batch's order."""
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        order: list[torch.Tensor] = []
        with torch.no_grad():
            for mb, index in self.micro_batches(batch, micro_batch_size=micro_batch_size, max_tokens=max_tokens,
                                                lengths=lengths):
                out = fn(mb, [0] if index is None else index.tolist())
                if index is None:
                    continue
                order.append(index)
                for k, v in out.items():
                    parts[k].append(v.cpu())
        perm = torch.cat(order)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(len(perm))
        return {k: torch.cat(v)[inverse] for k, v in parts.items()}

    def mini_batches(self, batch: Batch, num_mini_batches: int) -> list[Batch]:
        return strided_mini_batches(batch, num_mini_batches)

    # ------------------------------------------------------------------ optimizer
    def optimizer_step(self, grad_clip: float | None) -> tuple[float, bool]:
        """Clip and step; returns (grad_norm, skipped). A non-finite norm skips the step and drops the grads."""
        assert self.optimizer is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = total_grad_norm(params)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, True
        if grad_clip and grad_clip > 0 and grad_norm > grad_clip:
            coef = grad_clip / (grad_norm + 1e-6)
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, False

    @property
    def current_lr(self) -> float:
        assert self.optimizer is not None
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """DCP model + optimizer + LR scheduler + per-rank RNG (collective over the group)."""
        ckpt.save_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler,
                             process_group=self.process_group)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint saved by the same role on any world size (collective)."""
        ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler,
                             process_group=self.process_group)

