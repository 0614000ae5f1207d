"""Expert parallelism: a mixture-of-experts model's experts split over the ``ep`` ranks of a mesh dimension.

Training (`shard_experts`): each rank keeps ``experts / ep`` of every sparse block's experts (the stacked weights
become DTensors split on the expert dimension, so FSDP2 shards them further over the other data-parallel ranks, as
it shards TP's splits, and checkpoints, weight syncs and ``full_tensor()`` see whole experts). Ranks hold different
tokens, so in the forward every (token, chosen expert) row goes to the rank that holds its expert by an all-to-all
and comes back by a second one (`_expert_parallel_forward`).

Generation (`split_experts_over_tp`): the native engine's tensor-parallel ranks hold the same tokens (attention's
all-reduce leaves every rank the whole hidden state), so each runs the rows routed to its own experts and an
all-reduce sums the blocks' outputs, as TP's row-parallel down projection does for a dense MLP: no all-to-all.

The router and everything else stay the family's (`models.moe`).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from torchrlhf.models.moe import sparse_blocks


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward sends the gradients back the same way reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _expert_parallel_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor) -> torch.Tensor:
    """The sparse block's experts with each rank of the EP group holding ``experts / ep`` of them.

    Every (token, chosen expert) row goes to the rank holding that expert (all-to-all), runs through that
    expert's gate/up, activation and down projections there, and comes back (all-to-all) to be weighted and
    summed per token, as the family's own experts do. Gradients take the same path back.

    A rank's experts gather the weight gradients of its ``ep`` peers' tokens, where every other weight sees its
    own rank's only; data parallelism averages each weight's gradient over the ranks that hold it (the loss is
    scaled for it), so these are divided by ``ep`` here: FSDP2 then averages them over ``dp_mod_ep``, and every
    weight gets the mean over all data-parallel ranks. (A custom FSDP2 divide factor would do it too, but it
    needs a PREMUL_SUM reduction, which gloo lacks.)
    """
    group, ep = experts.ep_group, experts.ep_size
    w_gate_up = _ScaleGrad.apply(experts.gate_up_proj.to_local(), 1.0 / ep)  # this rank's experts
    w_down = _ScaleGrad.apply(experts.down_proj.to_local(), 1.0 / ep)
    local = w_gate_up.shape[0]
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # rows by expert, so by destination rank
    send = hidden_states[order // k]
    counts = torch.bincount(flat, minlength=local * ep).view(ep, local)  # [destination rank, its local expert]
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)  # [source rank, my local expert]
    in_splits, out_splits = counts.sum(1).tolist(), received.sum(1).tolist()
    rows = _AllToAll.apply(send, out_splits, in_splits, group)  # by source rank, then by my local expert
    expert_of = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(received.flatten())
    by_expert = torch.argsort(expert_of, stable=True)
    x = rows[by_expert]
    outs, start = [], 0
    for e, n in enumerate(received.sum(0).tolist()):
        gate, up = F.linear(x[start:start + n], w_gate_up[e]).chunk(2, dim=-1)
        outs.append(F.linear(experts.act_fn(gate) * up, w_down[e]))
        start += n
    computed = torch.cat(outs)  # by local expert
    y = computed.new_zeros(computed.shape).index_copy(0, by_expert, computed)  # back in the order received
    back = _AllToAll.apply(y, in_splits, out_splits, group)  # in the order this rank sent its rows
    out = torch.zeros(tokens * k, back.shape[-1], dtype=back.dtype, device=back.device).index_copy(0, order, back)
    return (out.view(tokens, k, -1) * top_k_weights[..., None].to(out.dtype)).sum(1).to(hidden_states.dtype)


def shard_experts(model: nn.Module, ep_mesh: DeviceMesh) -> int:
    """Expert parallelism: each sparse block's stacked expert weights become DTensors split on the expert dim
    over ``ep_mesh``, and its experts run `_expert_parallel_forward`. Returns the blocks changed.

    Call before FSDP2 (which then shards each rank's experts further over the other data-parallel ranks, as it
    shards TP's column splits) and before loading (a meta-device model stays on meta).
    """
    ep = ep_mesh.size()
    count = 0
    for gate, experts in sparse_blocks(model):
        if gate.num_experts % ep:
            raise ValueError(f"ep_size={ep} must divide the {gate.num_experts} experts of each MoE layer")
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(
                distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None),
                requires_grad=param.requires_grad))
        experts.ep_group, experts.ep_size = ep_mesh.get_group(), ep
        experts.forward = functools.partial(_expert_parallel_forward, experts)
        count += 1
    return count


def _local_experts_forward(experts: nn.Module, forward, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The family's experts forward over this rank's experts only, then the sum over the TP group. Choices of
    other ranks' experts become transformers' expert-parallel sentinel (index ``num_experts``, weight 0),
    which its experts implementations skip."""
    local = experts.num_experts  # this rank's
    index = top_k_index - experts.first_expert
    mine = (index >= 0) & (index < local)
    out = forward(hidden_states, torch.where(mine, index, local), torch.where(mine, top_k_weights, 0))
    return funcol.all_reduce(out, "sum", experts.tp_group)


def split_experts_over_tp(model: nn.Module, tp_mesh: DeviceMesh) -> int:
    """Keep rank ``r``'s ``torch.chunk(experts, tp, 0)[r]`` of every sparse block's stacked expert weights (plain
    tensors: the engine's weight contract chunks them on dim 0) and run them by `_local_experts_forward`. Returns
    the blocks changed; ValueError if the TP size does not divide the experts."""
    tp, rank = tp_mesh.size(), tp_mesh.get_local_rank()
    count = 0
    for gate, experts in sparse_blocks(model):
        if gate.num_experts % tp:
            raise ValueError(f"tensor parallelism (tp {tp}) must divide the {gate.num_experts} experts of each MoE "
                             "layer: the engine splits the experts over its TP ranks")
        local = gate.num_experts // tp
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(name, nn.Parameter(param.data[rank * local:(rank + 1) * local].clone(),
                                                          requires_grad=False))
        experts.num_experts, experts.first_expert, experts.tp_group = local, rank * local, tp_mesh.get_group()
        experts._is_expert_parallel = True  # transformers' sentinel handling in its grouped implementations
        experts.forward = functools.partial(_local_experts_forward, experts, experts.forward)
        count += 1
    return count
