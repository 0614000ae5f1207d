"""FSDP2 (× tensor parallel) for HF decoder-only models.

Order matters: tensor parallelism first (it turns weights into DTensors on the
TP mesh), then activation checkpointing, then FSDP2 `fully_shard` per
transformer block and at the root (which shards those DTensors further on the
DP mesh). For 2-D, `dp_mesh` and `tp_mesh` must be the two dimensions of one
2-D mesh, e.g. ``dp_mesh, tp_mesh = ParallelDims(world, tp).build_meshes(ranks, device_type)``
(`torchrlhf.runtime.ParallelDims`, the runtime's one layout of a worker group).

The TP plan has no sequence parallelism: activations between blocks stay
replicated on the TP group, so norms, rotary embeddings and the HF attention
(which reshapes with ``-1`` heads and so works on the local heads) run unchanged.
Qwen3's per-head q/k norms see only the local heads; their weights become
replicated DTensors so that their gradients are summed over the TP group.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from torchrlhf.models.lm_head import LogProbHead
from torchrlhf.models.expert_parallel import shard_experts
from torchrlhf.models.lora import lora_tp_style

# model_type values whose decoder layers have the Llama layout
# (self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj): the TP plan below fits them.
TP_SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")

# The one tensor-parallel plan of a decoder block, used by training (`apply_tp`) and by the native
# engine's generation layout: heads and MLP columns split, outputs of o_proj/down_proj summed.
BLOCK_TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel,
    "self_attn.k_proj": ColwiseParallel,
    "self_attn.v_proj": ColwiseParallel,
    "self_attn.o_proj": RowwiseParallel,
    "mlp.gate_proj": ColwiseParallel,
    "mlp.up_proj": ColwiseParallel,
    "mlp.down_proj": RowwiseParallel,
}


def block_tp_shard_dims() -> dict[str, int]:
    """Parameter-name suffix -> the dim `BLOCK_TP_PLAN` splits it on (colwise: out features and bias; rowwise: in)."""
    dims = {}
    for module, style in BLOCK_TP_PLAN.items():
        if style is ColwiseParallel:
            dims[f"{module}.weight"] = dims[f"{module}.bias"] = 0
        else:
            dims[f"{module}.weight"] = 1
    return dims


def find_transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder's ModuleList of blocks (`model.model.layers` for HF causal LMs)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers":
            return module
    raise ValueError(f"no transformer blocks (a ModuleList named 'layers') in {type(model).__name__}")


def _config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no HF `config`; cannot pick a tensor-parallel plan")
    return config


def _input_embeddings(model: nn.Module) -> nn.Embedding:
    return model.get_input_embeddings()


def _output_linear(model: nn.Module) -> nn.Linear | None:
    get = getattr(model, "get_output_embeddings", None)
    out = get() if get is not None else None
    return out if isinstance(out, nn.Linear) else None


def check_tp_compatible(model: nn.Module, tp_size: int) -> None:
    """Raise a ValueError unless the model's family has a TP plan and its head counts divide by `tp_size`."""
    config = _config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in TP_SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"tensor parallelism (tp={tp_size}) is not supported for architecture {model_type!r} "
            f"({type(model).__name__}); supported model types: {', '.join(TP_SUPPORTED_MODEL_TYPES)}"
        )
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tp={tp_size} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads} "
            f"of {model_type!r}"
        )
    if config.intermediate_size % tp_size:
        raise ValueError(f"tp={tp_size} must divide intermediate_size={config.intermediate_size}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Shard attention heads and MLP columns over `tp_mesh`; the embedding and the LM head by vocab rows.

    Inputs and outputs of every block stay replicated. The head becomes a `LogProbHead` whose weight is
    split by vocab rows (a tied head shares the sharded embedding DTensor): it scores tokens
    vocab-parallel and gathers logits only when asked for them.
    """
    check_tp_compatible(model, tp_mesh.size())
    embed = _input_embeddings(model)
    head = _output_linear(model)
    tied = head is not None and head.weight is embed.weight
    parallelize_module(embed, tp_mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    if head is not None:
        head = LogProbHead.install(model)
        if tied:
            head.weight = embed.weight  # Shard(0) on the vocab dim
        else:
            head.weight = nn.Parameter(distribute_tensor(head.weight, tp_mesh, [Shard(0)]),
                                       requires_grad=head.weight.requires_grad)
    for block in find_transformer_blocks(model):
        plan = {name: lora_tp_style(block.get_submodule(name), style)() for name, style in BLOCK_TP_PLAN.items()}
        for norm in ("q_norm", "k_norm"):  # Qwen3: RMSNorm over head_dim of [B, T, heads, head_dim]
            if getattr(block.self_attn, norm, None) is not None:
                # Each rank normalises its own heads; treating the input as sharded on the heads dim
                # makes the (replicated) norm weight's gradient the sum over all heads of the TP group.
                plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)


def split_blocks_over_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Generation's tensor parallelism: keep rank ``r``'s ``torch.chunk(weight, tp, dim)[r]`` of every projection
    `BLOCK_TP_PLAN` splits (the dims of `block_tp_shard_dims`), as plain tensors, and sum each row-split
    projection's output over the TP group. The same layout as `apply_tp`'s blocks without DTensor: a decode step of
    a small model spends most of its time in DTensor's dispatch otherwise (8x a TP=1 step on a CPU), and inference
    needs no gradients that DTensor would route. A mixture-of-experts block has no dense MLP projections (its
    experts: `split_experts_over_tp`); the engine checks that TP divides the heads."""
    tp, rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    for block in find_transformer_blocks(model):
        for name, style in BLOCK_TP_PLAN.items():
            parent, _, leaf = name.rpartition(".")
            linear = getattr(block.get_submodule(parent), leaf, None)
            if linear is None:
                continue
            rowwise = style is RowwiseParallel
            linear.weight = _chunk_param(linear.weight, tp, 1 if rowwise else 0, rank)
            if rowwise:  # a bias, if any, is added once, after the sum
                linear.forward = functools.partial(_row_split_forward, linear, group)
            elif linear.bias is not None:
                linear.bias = _chunk_param(linear.bias, tp, 0, rank)


def _chunk_param(param: nn.Parameter, chunks: int, dim: int, index: int) -> nn.Parameter:
    return nn.Parameter(param.data.chunk(chunks, dim)[index].clone(), requires_grad=param.requires_grad)


def _row_split_forward(linear: nn.Linear, group: dist.ProcessGroup, x: torch.Tensor) -> torch.Tensor:
    out = funcol.all_reduce(F.linear(x, linear.weight), "sum", group)
    return out if linear.bias is None else out + linear.bias


def default_param_dtype(mesh: DeviceMesh) -> torch.dtype | None:
    """bf16 compute on accelerators, full fp32 on CPU (None = keep the parameters' dtype)."""
    return torch.bfloat16 if mesh.device_type != "cpu" else None


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward (non-reentrant torch.utils.checkpoint per block).

    Uses HF's per-layer checkpointing, which keeps parameter names unchanged (so
    state dicts and DCP checkpoints look the same with and without it). A
    `ValueModel` delegates to its backbone (`.model`).
    """
    for target in (model, getattr(model, "model", None)):
        if getattr(target, "supports_gradient_checkpointing", False):
            kwargs = {"use_reentrant": False}
            if hasattr(target, "activation_checkpointing_enable"):
                target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            return
    raise ValueError(f"{type(model).__name__} does not support activation checkpointing")


def model_layout(ranks: int, dtype: torch.dtype, *, trainable: bool, cpu_offload: bool = False,
                 lora: bool = False) -> str:
    """How a role holds its model on a group of ``ranks`` (data-parallel × tensor-parallel) ranks computing
    in ``dtype``; the one rule the workers build by and the dry run's memory estimate counts by:

    - ``"plain"``: one rank with nothing to shard: the module as it is, in ``dtype`` (float32, or a frozen
      model below it: nothing updates it, so it needs no float32 master);
    - ``"copies"``: one rank training below float32: float32 parameters and their compute copies
      (`models.compute_copies.ComputeCopies`, FSDP2's mixed-precision numerics without its buffers);
    - ``"fsdp"``: FSDP2 (× TP), float32 master shards cast to ``dtype`` per use. Also on one rank with CPU
      offload, or LoRA below float32 (its frozen base is held in ``dtype``, its adapters in float32).
    """
    if ranks > 1 or cpu_offload or (lora and trainable and dtype != torch.float32):
        return "fsdp"
    if dtype == torch.float32 or not trainable:
        return "plain"
    return "copies"


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each transformer block's forward, as torchtitan does: RMSNorm, RoPE, SwiGLU and the
    residual adds fuse into a few kernels forward and backward, while FSDP2's hooks, activation
    checkpointing and the loss stay eager around the blocks. The blocks share one compiled graph (their
    parameters are its inputs), compiled with dynamic shapes at once: RL batches change length every
    micro-batch, and a first static compile would only be thrown away at the second length (on an H100 it
    cost a second 50 s step). Parameter names do not change (the module is not wrapped), so checkpoints
    are the same. A `LogProbHead` compiles its tiles' arithmetic too (`algorithms.logprob._compiled_tiles`)."""
    for block in find_transformer_blocks(model):
        block.forward = torch.compile(block.forward, dynamic=True)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, LogProbHead):
        head.compile = True


def parallelize(
    model: nn.Module,
    *,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Apply TP (if `tp_mesh` has > 1 rank), activation checkpointing, then FSDP2 per block and at the root.

    Works on a model on the meta device (then call `load_weights`/`materialize`
    afterwards) or on a real one. `param_dtype=None` picks bf16 on GPU, the
    parameters' own dtype on CPU. Returns the same (now sharded) module.

    ``expert_mesh`` (a mixture-of-experts model; `ParallelDims.build_expert_mesh`): the 2-D
    ``("dp_mod_ep", "ep")`` mesh of the same ranks. Expert parallelism splits each sparse block's experts over
    ``ep`` (`models.expert_parallel.shard_experts`), and FSDP2 shards each rank's experts over ``dp_mod_ep`` as a group of
    their own (FSDP2 averages their gradients over ``dp_mod_ep``; the EP forward averages over ``ep``).
    """
    if tp_mesh is not None and tp_mesh.size() > 1:
        apply_tp(model, tp_mesh)
    if expert_mesh is not None and not shard_experts(model, expert_mesh["ep"]):
        raise ValueError(f"expert parallelism (ep {expert_mesh['ep'].size()}) needs a mixture-of-experts model; "
                         f"{type(model).__name__} has no sparse block")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    if param_dtype is None:
        param_dtype = default_param_dtype(dp_mesh)
    fsdp_kwargs = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
    )
    if cpu_offload:
        # Pinned host memory needs an accelerator; on a CPU mesh offloading is a no-op anyway.
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=dp_mesh.device_type != "cpu")
    blocks = find_transformer_blocks(model)
    if expert_mesh is not None:
        expert_kwargs = {**fsdp_kwargs, "mesh": expert_mesh["dp_mod_ep"]}
        for module in list(model.modules()):
            experts = getattr(module, "experts", None)
            if experts is not None and hasattr(experts, "ep_size"):  # split by `shard_experts`
                fully_shard(experts, reshard_after_forward=reshard_after_forward, **expert_kwargs)
    for i, block in enumerate(blocks):
        # The last block's params are needed again right away in backward: keep them gathered.
        last = i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard_after_forward and not last, **fsdp_kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **fsdp_kwargs)
    return model
