"""What the FSDP2 roles share: meshes, sharding, micro-batch loops, the one training loop, checkpoints.

`ActorWorker`, `CriticWorker` and `RewardModelWorker` subclass `FSDPWorker`. The training loop
(`FSDPWorker.train`: epochs × mini-batches × micro-batches, gradient accumulation, the shared-prompt
passes, clipping, the non-finite skip, the optimizer and LR steps) exists here once; a trainable role
supplies only its forward and its loss (`FSDPWorker.micro_batch_loss`) and the names of its loss metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchrlhf.data import Batch
from torchrlhf.models import (
    build_meta_causal_lm,
    build_meta_value_model,
    load_causal_lm,
    load_value_model,
    load_value_weights,
)
from torchrlhf.models.lora import LoRAConfig, hold_frozen_in, init_lora, inject_lora, lora_init_tensors
from torchrlhf.models.compute_copies import ComputeCopies
from torchrlhf.models.parallelize import compile_blocks, enable_activation_checkpointing, model_layout, parallelize
from torchrlhf.models.sharded import load_weights
from torchrlhf.runtime.registry import process_group
from torchrlhf.runtime.worker import Dispatch, Worker, register
from torchrlhf.utils import checkpoint as ckpt
from torchrlhf.utils import flops, snapshot
from torchrlhf.utils.activation_offload import host_bytes_available
from torchrlhf.models.packed_attention import PrefixKV
from torchrlhf.utils.compile_cache import enable_compile_cache
from torchrlhf.utils.optim import CLIP_GRAD_KEY, DEFAULT_CLIP_GRAD, build_optimizer
from torchrlhf.utils.pystack import in_fresh_stack_chunk
from torchrlhf.workers.microbatch import Batching, micro_batch_groups, strided_mini_batches
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, forward_counts, run_prefixes

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


@dataclass(frozen=True)
class MemorySaving:
    """Ways a trainable role trades speed for device memory (its ``memory`` section).

    ``activation_checkpointing``: recompute each block's activations in backward instead of keeping them.
    ``cpu_offload``: FSDP2 keeps the parameters, gradients and optimizer state in host memory.
    ``offload_prefix_activations``: with ``shared_prefix``, what the mini-batch's prompt pass saves for backward
    waits in host memory while the suffix micro-batches run (`utils.activation_offload`).
    """

    activation_checkpointing: bool = False
    cpu_offload: bool = False
    offload_prefix_activations: bool = False


@dataclass(frozen=True)
class TrainingRun:
    """What the controller tells a trainable role of the run it trains in, never a config key: responses per
    prompt (``rollout.n``, which turns mini-batch sizes in prompts into samples) and the number of updates
    (``trainer.total_steps``, the LR schedule's length; None: no decay)."""

    rollout_n: int = 1
    total_steps: int | None = None


@dataclass
class MiniBatchTotals:
    """Global counts of one mini-batch, over every data-parallel rank: what per-micro-batch losses divide by."""

    tokens: float
    seqs: float
    normalizer: float  # tokens for "token-mean" aggregation, sequences otherwise


class FSDPWorker(Worker):
    """A worker whose model is FSDP2-sharded over its group (× TP when ``tp_size > 1``).

    Its layout is the group's `ParallelDims`: ranks of one TP group are adjacent in the worker group;
    they share a ``dp_rank`` and receive the same data shard. A trainable role calls `_init_training`
    and serves its update through `train`.
    """

    role = "worker"  # config section and metric prefix: "actor", "critic"
    OPTIM_DEFAULTS: dict = {}  # the role's defaults under its ``optim`` section (e.g. the actor's lr)
    # The keys `micro_batch_loss` reports, the same on every rank (a role sets them for its configuration):
    loss_metrics: tuple[str, ...] = ()  # summed over micro-batches and data-parallel ranks
    max_metrics: tuple[str, ...] = ()  # maximised instead
    lora: LoRAConfig | None = None  # adapters on a frozen base (`models.lora`); None: every weight trains
    shared_prefix: bool = False  # each distinct prompt once per mini-batch (`workers.shared_prefix`)
    offload_prefix_activations: bool = False  # the prompt pass's saved tensors in host memory until its backward

    def __init__(self, *, tp_size: int = 1, ep_size: int = 1, seed: int = 0) -> None:
        super().__init__(tp=tp_size, ep=ep_size)
        if self.parallel_dims.ep != ep_size:
            raise ValueError(f"{self.role}: ep_size={ep_size}, but the group's layout has ep {self.parallel_dims.ep}")
        self.expert_mesh = None
        if self.process_group is None:  # a one-process worker (unit tests, notebooks): nothing to shard over
            if self.tp_size > 1 or ep_size > 1:
                raise ValueError(f"tp_size={self.tp_size}, ep_size={ep_size} need torch.distributed (run under "
                                 "torchrun)")
            self.dp_mesh, self.tp_mesh = None, None
        else:
            self.dp_mesh, self.tp_mesh = self.build_meshes()
            self.expert_mesh = self.build_expert_mesh()
        self.dp_group = self.dp_mesh.get_group() if self.dp_mesh is not None else None
        self.seed = seed
        torch.manual_seed(seed)  # same on every rank: any random init must agree before FSDP shards it
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.compute_dtype = torch.float32  # the dtype its matmuls run in (`_shard`), for the MFU's peak
        self.compute_copies: ComputeCopies | None = None  # one rank training below float32 (`_shard`)
        self._flops_of: flops.TransformerFlops | None = None
        self._step_flops = 0  # model FLOPs of the `train` call in progress
        self._snapshot_writer = snapshot.SnapshotWriter()  # `train` and checkpointing wait for its write
        self._snapshot_peer: snapshot.PeerLink | None = None  # where each snapshot's copy goes (another node)

    @property
    def tp_size(self) -> int:
        return self.parallel_dims.tp

    def _set_shared_prefix(self, shared_prefix: bool, memory: MemorySaving) -> None:
        if memory.offload_prefix_activations and not shared_prefix:
            raise ValueError(f"{self.role}.memory.offload_prefix_activations needs {self.role}.shared_prefix: true "
                             "(it offloads the shared prompt pass's activations)")
        self.shared_prefix, self.offload_prefix_activations = shared_prefix, memory.offload_prefix_activations

    # ------------------------------------------------------------------ setup
    def _layout(self, dtype: torch.dtype, cpu_offload: bool, trainable: bool) -> str:
        """How this group holds its model (`models.parallelize.model_layout`). A one-process worker (no
        process group: unit tests, notebooks) holds it plain in float32."""
        if self.dp_mesh is None:
            return "plain"
        return model_layout(self.group_size, dtype, trainable=trainable, cpu_offload=cpu_offload,
                            lora=self.lora is not None)

    def loads_sharded(self, model_path: str, dtype: torch.dtype, cpu_offload: bool, trainable: bool = True) -> bool:
        """Whether the model is built on the meta device and each rank reads only its shards: whenever it
        is FSDP2-sharded and the weights are a safetensors directory (a GGUF file loads whole)."""
        return self._layout(dtype, cpu_offload, trainable) == "fsdp" and Path(model_path).is_dir()

    def _build_model(
        self,
        model_path: str,
        dtype: torch.dtype,
        *,
        value_head: bool = False,
        freeze: bool = False,
        memory: MemorySaving = MemorySaving(),
        init_head_std: float | None = None,
        compile: bool = False,
    ) -> torch.nn.Module:
        """The role's model (a causal LM, or a `ValueModel` with ``value_head``), sharded over the group.

        When it is FSDP2-sharded and the weights are safetensors, it is built on the meta device and each
        rank reads only its own rows (`loads_sharded`); otherwise it is loaded whole, then sharded. A fresh
        value head is drawn from ``self.seed``, identical on every rank. With ``self.lora`` the targeted
        Linear layers get adapters before sharding (so TP and FSDP2 shard them too), drawn from the seed;
        only they train, and with a compute ``dtype`` below float32 the frozen base is held in it. With
        ``compile`` each transformer block's forward runs through ``torch.compile`` (`compile_blocks`).
        """
        cpu_offload = memory.cpu_offload
        sharded = self.loads_sharded(model_path, dtype, cpu_offload, trainable=not freeze)
        if value_head:
            model = build_meta_value_model(model_path) if sharded else load_value_model(
                model_path, dtype=torch.float32, init_head_std=init_head_std, seed=self.seed)
        else:
            model = build_meta_causal_lm(model_path) if sharded else load_causal_lm(model_path, dtype=torch.float32)
            model.config.use_cache = False
        if freeze:
            model.requires_grad_(False)
        if self.lora is not None:
            inject_lora(model, self.lora)
            if not sharded:
                init_lora(model, self.seed)
            if dtype.itemsize < 4:  # FSDP2 computes in ``dtype`` (a plain model is float32)
                hold_frozen_in(model, dtype)
        model = self._shard(model, dtype, memory.activation_checkpointing and not freeze, cpu_offload,
                            trainable=not freeze)
        if compile:
            enable_compile_cache()
            compile_blocks(model)
        if sharded and value_head:
            load_value_weights(model, model_path, device=self.device, init_head_std=init_head_std, seed=self.seed,
                               cpu_offload=cpu_offload)
        elif sharded:
            adapters = lora_init_tensors(model, self.seed) if self.lora is not None else None
            load_weights(model, model_path, device=self.device, cpu_offload=cpu_offload, extra=adapters)
        return model

    def _shard(self, model: torch.nn.Module, dtype: torch.dtype, activation_checkpointing: bool, cpu_offload: bool,
               trainable: bool = True):
        """Hold the model as `_layout` says: FSDP2 (× TP) over the group's ranks (a meta-device model stays
        on meta), or on one rank the plain module (in ``dtype`` when frozen), or float32 parameters with
        compute copies in ``dtype`` (`self.compute_copies`)."""
        self.compute_dtype = dtype
        layout = self._layout(dtype, cpu_offload, trainable)
        if layout == "fsdp":
            return parallelize(
                model,
                dp_mesh=self.dp_mesh,
                tp_mesh=self.tp_mesh,
                expert_mesh=self.expert_mesh,
                param_dtype=dtype,
                reduce_dtype=torch.float32,
                cpu_offload=cpu_offload,
                activation_checkpointing=activation_checkpointing,
            )
        if activation_checkpointing:
            enable_activation_checkpointing(model)
        if layout == "copies":
            model = model.to(self.device)
            self.compute_copies = ComputeCopies(model, dtype)
            return model
        one_process = self.dp_mesh is None  # `_layout`: a one-process worker holds its model plain in float32
        return model.to(self.device, torch.float32 if one_process else dtype)

    def computing(self) -> contextlib.AbstractContextManager:
        """Where the model's forward and backward run: with the compute copies when it has them."""
        return self.compute_copies.active() if self.compute_copies is not None else contextlib.nullcontext()

    def _init_training(self, *, optim: Mapping | None, batching: Batching | Mapping | None, run: TrainingRun,
                       loss_agg_mode: str) -> None:
        """What `train` needs: the batch sizes (validated for this group), the optimizer, its schedule and the
        gradient clip (``optim.clip_grad``)."""
        self.batching = batching if isinstance(batching, Batching) else Batching(**(batching or {}))
        self.batching.validate(rollout_n=run.rollout_n, dp_size=self.dp_size, role=self.role)
        self.rollout_n = run.rollout_n
        self.loss_agg_mode = loss_agg_mode
        optim = {**self.OPTIM_DEFAULTS, **(optim or {})}
        self.grad_clip = optim.get(CLIP_GRAD_KEY, DEFAULT_CLIP_GRAD)
        self.optimizer, self.lr_scheduler = build_optimizer(self.model.parameters(), optim, total_steps=run.total_steps)

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
    def check_local_batch(self, batch: Batch) -> int:
        """Number of mini-batches in this rank's shard; ValueError (quoting sizes) if it does not split."""
        mini = self.batching.ppo_mini_batch_size
        per_rank = mini * self.rollout_n // self.dp_size
        if len(batch) == 0 or len(batch) % per_rank:
            raise ValueError(
                f"{self.role}.update got {len(batch)} samples on data-parallel rank {self.dp_rank}/{self.dp_size}; "
                f"a mini-batch is {mini} prompts x {self.rollout_n} responses / {self.dp_size} ranks = "
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

    def infer(self, batch: Batch, fn: Callable[..., dict[str, torch.Tensor]], name: str) -> Batch:
        """A no-grad pass: ``fn(micro_batch, rows, plan, prefix)`` per micro-batch, outputs in batch order.

        With ``shared_prefix`` every distinct prompt runs once first and ``fn`` reads its keys/values
        (``plan``/``prefix`` are None otherwise). The pass's MFU goes in ``meta["perf/mfu/<name>"]``.
        """
        start = time.perf_counter()
        self.model.eval()
        plan = prefix = lengths = None
        with self.computing():
            if self.shared_prefix:
                with torch.no_grad():
                    plan, prefix, lengths = run_prefixes(self.model, batch, self.window, self.device)
            outs = in_fresh_stack_chunk(self.map_micro_batches, batch, lambda mb, rows: fn(mb, rows, plan, prefix),
                                        micro_batch_size=self.batching.log_prob_micro_batch_size,
                                        max_tokens=self.batching.max_tokens, lengths=lengths)
        seconds = time.perf_counter() - start
        model_flops = self.flops_of.forward(*forward_counts(batch, plan))
        return Batch(outs, meta={f"perf/mfu/{name}": self.mfu(model_flops, seconds)})

    # ------------------------------------------------------------------ the training loop
    def train(self, batch: Batch, *, needs: Sequence[str], **loss_kwargs) -> dict[str, float]:
        """PPO epochs × mini-batches (one optimizer step each) × micro-batches (gradient accumulation).

        Each micro-batch loss is normalised by the whole mini-batch's global token (or sequence) count
        (`MiniBatchTotals`), so the accumulated gradient is the mini-batch gradient whatever the
        micro-batching and data-parallel split. FSDP averages gradients over data-parallel ranks, so the
        backward loss is scaled by ``dp_size``. ``needs``: the columns the loss reads; ``loss_kwargs`` go to
        every `micro_batch_loss` call.
        """
        self._snapshot_writer.wait()  # a snapshot still being written holds the state this call changes
        num_mini = self.check_local_batch(batch)
        missing = [k for k in needs if k not in batch]
        if missing:
            raise KeyError(f"{self.role}.update: batch lacks columns {missing}; it has {batch.keys()}")
        lr = self.current_lr
        start, self._step_flops = time.perf_counter(), 0
        self.model.train()
        sums: dict[str, list[float]] = defaultdict(list)
        skipped = 0
        for _ in range(self.batching.ppo_epochs):
            for mini in self.mini_batches(batch, num_mini):
                with self.computing():  # the micro-batch loop, a hot loop: no Python stack-chunk boundary inside it
                    stats = in_fresh_stack_chunk(self._train_mini_batch, mini, loss_kwargs)
                grad_norm, skip = self.optimizer_step(self.grad_clip)
                skipped += int(skip)
                if not skip:
                    stats[f"{self.role}/grad_norm"] = grad_norm
                for k, v in stats.items():
                    sums[k].append(v)
        self.lr_scheduler.step()
        metrics = {k: sum(v) / len(v) for k, v in sums.items()}
        metrics[f"{self.role}/lr"] = lr
        metrics[f"{self.role}/grad_norm_nonfinite"] = float(skipped > 0)
        metrics[f"{self.role}/skipped_steps"] = float(skipped)
        metrics[f"perf/mfu/{self.role}"] = self.mfu(self._step_flops, time.perf_counter() - start)
        return metrics

    def _train_mini_batch(self, mini: Batch, loss_kwargs: dict) -> dict[str, float]:
        """Accumulate one mini-batch's gradient; returns its globally reduced loss metrics."""
        mask = mini["response_mask"]
        tokens, seqs = self.dp_sum([float(mask.sum()), float((mask.sum(-1) > 0).sum())])
        totals = MiniBatchTotals(tokens, seqs, tokens if self.loss_agg_mode == "token-mean" else seqs)
        sums: dict[str, float] = defaultdict(float)
        maxes: dict[str, float] = defaultdict(float)
        plan = prefix = lengths = None
        if self.shared_prefix:  # prompts forward once here, backward once after the micro-batches
            offload = self.offload_prefix_activations
            plan, prefix, lengths = run_prefixes(self.model, mini, self.window, self.device,
                                                 offload_to="cpu" if offload else None,
                                                 offload_limit=host_bytes_available() if offload else None)
        self._step_flops += self.flops_of.train(*forward_counts(mini, plan))
        for mb, index in self.micro_batches(mini, micro_batch_size=self.batching.ppo_micro_batch_size_per_device,
                                            max_tokens=self.batching.max_tokens, lengths=lengths):
            real = index is not None  # filler micro-batches only keep collectives in step
            rows = index.tolist() if real else [0]
            loss, stats = self.micro_batch_loss(mb, rows, plan, prefix, totals, real=real, **loss_kwargs)
            (loss * ((1.0 if real else 0.0) * self.dp_size)).backward()
            if not real:
                continue
            for k, v in stats.items():
                if k in self.max_metrics:
                    maxes[k] = max(maxes[k], v)
                else:
                    sums[k] += v
        if prefix is not None:
            prefix.backward()
        out = dict(zip(self.loss_metrics, self.dp_sum([sums[k] for k in self.loss_metrics])))
        if self.max_metrics:
            out.update(zip(self.max_metrics, self.dp_max([maxes[k] for k in self.max_metrics])))
        return out

    def micro_batch_loss(self, mb: Batch, rows: list[int], plan: SharedPrefixPlan | None, prefix: PrefixKV | None,
                         totals: MiniBatchTotals, *, real: bool, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
        """The role's forward and loss on one micro-batch (rows ``rows`` of the mini-batch's ``plan`` when
        sharing prompts): (loss to backward, its metric contributions). ``real`` is False for a filler
        micro-batch, whose loss is run for its collectives and discarded."""
        raise NotImplementedError(f"{type(self).__name__} is not trainable")

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

    # ------------------------------------------------------------------ MFU
    @property
    def flops_of(self) -> flops.TransformerFlops:
        """The model's FLOP counts (`utils.flops`), read off it once."""
        if self._flops_of is None:
            self._flops_of = flops.TransformerFlops.from_model(self.model)
        return self._flops_of

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def peak_flops(self, given: float | None = None) -> float:
        """This rank's peak FLOP/s in its compute dtype: ``given`` (``trainer.peak_flops``), else measured
        now, once per process (`utils.flops.matmul_peak`, with the threads its calls run on)."""
        flops.set_peak_flops(given)
        return flops.peak_flops(self.compute_dtype, self.device)

    def mfu(self, model_flops: float, seconds: float) -> float:
        """``model_flops`` done in ``seconds`` on this rank as a fraction of its peak."""
        return model_flops / max(seconds, 1e-9) / flops.peak_flops(self.compute_dtype, self.device)

    # ------------------------------------------------------------------ checkpoints
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """DCP model + optimizer + LR scheduler + per-rank RNG (collective over the group). With LoRA only
        the adapters are saved (the base is the model the run starts from), with their config."""
        extra = {"lora": dataclasses.asdict(self.lora)} if self.lora is not None else None
        self._snapshot_writer.wait()
        ckpt.save_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler,
                             process_group=self.process_group, trainable_only=self.lora is not None, extra=extra)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore a checkpoint saved by the same role on any world size (collective)."""
        self._snapshot_writer.wait()
        ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.lr_scheduler,
                             process_group=self.process_group, trainable_only=self.lora is not None)

    # ------------------------------------------------------------------ memory snapshots (`utils.snapshot`)
    # The controller names the run's snapshot directory; this rank's files live in its node's part of it.
    def _snapshot_args(self) -> dict:
        return dict(role=self.context.group_name, rank=self.rank, model=self.model, optimizer=self.optimizer,
                    scheduler=self.lr_scheduler, process_group=self.process_group,
                    trainable_only=self.lora is not None)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def reserve_snapshot(self, root: str) -> int:
        """Claim this rank's shared memory for both snapshot slots now (a clear error if it is too small), and
        for the copy it keeps of another node's rank; returns one slot's bytes (with that copy)."""
        here, role = snapshot.node_root(root), self.context.group_name
        nbytes = snapshot.estimate_bytes(self.model, trainable_only=self.lora is not None)
        snapshot.reserve(here, role, self.rank, nbytes)
        if self._snapshot_peer is None:
            return nbytes
        kept = self._snapshot_peer.swap_sizes(nbytes)
        snapshot.reserve(here, role, self._snapshot_peer.from_, kept, copy_of=True)
        return nbytes + kept

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def connect_snapshot_peers(self, group_key: str) -> int:
        """Send every snapshot's copy to a rank on another node from now on (collective over the process group
        ``group_key``, the role's ranks); returns the rank that keeps this rank's copy."""
        self._snapshot_peer = snapshot.PeerLink.connect(process_group(group_key), self.role)
        return self._snapshot_peer.to

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_snapshot(self, root: str, slot: int, step: int) -> int:
        """Start writing this rank's state into ``slot`` in the background (and its copy to the peer node); returns
        its bytes. The slot names ``step`` once `finish_snapshot` returns (training may go on meanwhile; see
        `SnapshotWriter`)."""
        return self._snapshot_writer.start(snapshot.node_root(root), slot, step, peer=self._snapshot_peer,
                                           **self._snapshot_args())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def finish_snapshot(self) -> int:
        """Wait until the snapshot being written is whole; returns its bytes (0: none was being written)."""
        return self._snapshot_writer.wait()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def snapshot_holdings(self, root: str, slot: int) -> dict:
        """What this rank's node keeps of ``slot``: this rank's part (``own``, its step) and other ranks' copies."""
        return snapshot.snapshot_holdings(snapshot.node_root(root), slot, self.context.group_name, self.rank)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_snapshot(self, root: str, slot: int, step: int, sources: dict[int, int] | None = None) -> None:
        """Restore ``slot``; ``sources`` ({lost rank: the rank keeping its copy}) first gives the ranks that lost
        their part (a replaced node) their copy back (collective over the peer group)."""
        self._snapshot_writer.wait()
        here = snapshot.node_root(root)
        if sources:
            if self._snapshot_peer is None:
                raise RuntimeError("load_snapshot: copies from peers need connect_snapshot_peers first")
            snapshot.fetch_copies(here, slot, self.context.group_name, self.rank, sources, self._snapshot_peer.group)
        snapshot.load_snapshot(here, slot, step, **self._snapshot_args())

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def drop_snapshot(self, root: str) -> None:
        self._snapshot_writer.wait()
        snapshot.drop_snapshot(snapshot.node_root(root), self.context.group_name, self.rank)

