"""The train→generate transition as a context: weights in, training memory out, everything back on exit.

A worker runs the whole transition inside one controller call (``RolloutWorker.generate``, colocated):

    with generation_mode(self.model, self.engine, optimizer=self.optimizer) as stats:
        out = self.engine.generate(prompts, sampling)

The engine is a `torchrlhf.generation.RolloutEngine` (`NativeEngine`, `VLLMEngine`):

- ``resume(("weights",))``, then the weights, then ``resume(("kv_cache",))``; ``release()`` frees both.
- ``update_weights(named_tensors)``: consume an iterator of ``(hf_name, local_tensor)`` in the generation
  layout, copying each tensor before taking the next (the resharder frees it when the iterator resumes).
  Tied parameters come once, under their first name (``model.embed_tokens.weight`` for a tied Llama head).
- ``param_shard_dims() -> {name: dim | None}``: the dim each parameter is split on across TP ranks.
- ``tp_size`` and ``tp_mesh`` (1-D, None at TP=1). With TP > 1 the engine must be built on
  ``generation_mesh(train_mesh, tp)["tp"]`` (see `layout`), so that its TP groups are the strided
  HybridFlow groups; `generation_mode` checks this and raises otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchrlhf.data import Batch
from torchrlhf.hybrid.layout import generation_mesh, training_mesh
from torchrlhf.hybrid.reshard import ReshardStats, TpDimFn, iter_generation_weights
from torchrlhf.models.lora import adapter_shard_dims, merge_stream, module_scalings


def resolve_generation_mesh(model: nn.Module, engine: Any) -> DeviceMesh | None:
    """The ("dp", "tp") generation mesh for `model`'s training mesh and the engine's TP size (built once, cached).

    None when the model has no DTensor parameters (single process, nothing to reshard). Raises if the
    engine's TP mesh is not this mesh's TP group.
    """
    train = training_mesh(model)
    if train is None:
        return None
    tp_size = engine.tp_size
    mesh = generation_mesh(train, tp_size)
    engine_tp = engine.tp_mesh
    if engine_tp is not None and engine_tp.mesh.tolist() != mesh["tp"].mesh.tolist():
        raise ValueError(
            f"{type(engine).__name__} runs TP over ranks {engine_tp.mesh.tolist()} but the generation layout's TP "
            f"group of this rank is {mesh['tp'].mesh.tolist()}; build the engine with "
            f"tp_mesh=torchrlhf.hybrid.generation_mesh(train_mesh, {tp_size})['tp']"
        )
    return mesh


def engine_tp_dims(engine: Any) -> TpDimFn:
    """name -> TP dim from ``engine.param_shard_dims()``, and the dims of LoRA factors that merge into those weights
    (`models.lora.adapter_shard_dims`)."""
    dims = engine.param_shard_dims()
    dims = {**adapter_shard_dims(dims), **dims}
    return lambda name: dims.get(name)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class OptimizerOffload:
    """Optimizer state copied to (pinned) host memory, its storage freed in place, refilled by `restore`.

    `generation_mode` uses it only for models on an accelerator (on CPU there is nothing to gain).
    Step counters (0-dim) stay where they are.

    Freeing the storage (rather than replacing the tensors) keeps every reference the optimizer and
    FSDP hold valid, DTensor state included.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.saved: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        for state in optimizer.state.values():
            for value in state.values():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                local = _local(value)
                storage = local.untyped_storage()
                if storage.nbytes() == 0:
                    continue
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                host.untyped_storage().copy_(storage, non_blocking=True)
                self.saved.append((local, host, storage.nbytes()))
        _synchronize()
        for local, _, _ in self.saved:
            local.untyped_storage().resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def restore(self) -> None:
        for local, host, nbytes in self.saved:
            storage = local.untyped_storage()
            storage.resize_(nbytes)
            storage.copy_(host.untyped_storage(), non_blocking=True)
        _synchronize()
        self.saved.clear()


def _reshard(model: nn.Module) -> None:
    """Put every FSDP2 module back in its sharded state (a forward without backward can leave some gathered)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextmanager
def generation_mode(
    model: nn.Module,
    engine: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    offload: bool = True,
    gen_mesh: DeviceMesh | None = None,
    tp_dim_of: TpDimFn | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[ReshardStats]:
    """Load `model`'s current weights into `engine` for the body; give the memory back to training after.

    A LoRA model's adapters are merged into their weights on the way (`models.lora.merge_stream`: each
    merged weight is computed from the streamed shards, out of place); the engine sees plain HF weights,
    and the training model is never merged or unmerged.

    Collective over the model's ranks (call it on every rank, in the same order). Grads are dropped
    (set to None: generation happens between optimizer steps); with `offload` and a model on an
    accelerator the optimizer state goes to pinned host memory until exit. On exit, exception or not,
    ``engine.release()`` runs and the optimizer state is restored. Yields the transition's `ReshardStats`.
    """
    _reshard(model)
    for p in model.parameters():
        p.grad = None
    on_device = any(p.device.type != "cpu" for p in model.parameters())
    offloaded = OptimizerOffload(optimizer) if (offload and optimizer is not None and on_device) else None
    stats = ReshardStats()
    try:
        engine.resume(("weights",))  # weights before the KV cache: the incoming tensors need their memory first
        mesh = gen_mesh if gen_mesh is not None else resolve_generation_mesh(model, engine)
        dims = tp_dim_of or engine_tp_dims(engine)
        scalings = module_scalings(model)
        if mesh is None:  # no distributed training layout: hand over the plain parameters
            plain = ((n, p.detach()) for n, p in model.named_parameters())
            engine.update_weights(merge_stream(plain, scalings) if scalings else plain)
        else:
            stream = iter_generation_weights(model, mesh, dims, dtype=dtype, stats=stats)
            engine.update_weights(merge_stream(stream, scalings) if scalings else stream)
            if next(stream, None) is not None:
                raise RuntimeError(f"{type(engine).__name__}.update_weights stopped before the last parameter")
        engine.resume(("kv_cache",))
        yield stats
    finally:
        engine.release()
        if offloaded is not None:
            offloaded.restore()


def _gather_tp_prompts(prompts: Batch, mesh: DeviceMesh) -> tuple[Batch, int, int]:
    """All prompts of this rank's TP group (TP ranks must generate the same batch); my offset and count."""
    group = mesh.get_group("tp")
    shards: list[Batch | None] = [None] * mesh.size(1)
    dist.all_gather_object(shards, prompts, group=group)
    me = mesh.get_local_rank("tp")
    return Batch.concat(shards), sum(len(s) for s in shards[:me]), len(prompts)


def generate_with_current_weights(
    model: nn.Module,
    engine: Any,
    prompts: Batch,
    sampling: Any,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    offload: bool = True,
    dtype: torch.dtype | None = None,
    generate: Callable[[Batch, Any], Batch] | None = None,
    **generate_kwargs: Any,
) -> Batch:
    """``engine.generate(prompts, sampling, **generate_kwargs)`` with the training model's current weights: the
    actor's rollout. ``generate`` replaces ``engine.generate`` for a rollout that drives the engine itself
    (an agent harness sampling its endpoint calls through it); such a rollout runs at generation TP 1.

    For ``RolloutWorker.generate`` colocated with the actor: one controller call per rollout, every rank of
    the actor group runs it (the transition is collective), each with its own DP_COMPUTE shard of prompts.

    With generation TP > 1 the ranks of a TP group pool their shards (TP ranks must decode the same
    batch), generate once, and each returns the rows of its own prompts, so the training-layout
    dispatch (one shard per rank) works unchanged; ``generate_kwargs`` go to that one call as they are (an
    argument per sample, like agent ``sessions``, would have to cover the pooled batch: agents run at TP 1).
    The transition's time and traffic go to the output's ``meta`` as ``perf/reshard_s`` and
    ``perf/reshard_received_gb`` (see `ReshardStats`), which the trainer logs with the other ``perf/*`` figures.
    """
    with generation_mode(model, engine, optimizer=optimizer, offload=offload, dtype=dtype) as stats:
        mesh = resolve_generation_mesh(model, engine)
        if generate is not None:
            if mesh is not None and mesh.size(1) > 1:
                raise ValueError("a rollout with its own generate (an agent harness) runs at generation TP 1")
            out = generate(prompts, sampling, **generate_kwargs)
        elif mesh is None or mesh.size(1) == 1:
            out = engine.generate(prompts, sampling, **generate_kwargs)
        else:
            pooled, offset, count = _gather_tp_prompts(prompts, mesh)
            out = engine.generate(pooled, sampling, **generate_kwargs)
            n = len(out) // max(len(pooled), 1)
            out = out[offset * n : (offset + count) * n]
    out.meta["perf/reshard_s"] = stats.seconds
    out.meta["perf/reshard_received_gb"] = stats.bytes_received / 2**30
    return out
