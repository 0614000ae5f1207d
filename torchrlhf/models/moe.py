"""Mixture-of-experts: the router of every MoE block, the load-balancing loss, and the expert checkpoint layout.

The model definition stays the HF family's (Qwen3-MoE's sparse block: ``mlp.gate`` routes, ``mlp.experts`` holds
the experts as two 3-D weights run by grouped GEMMs, ``torch._grouped_mm`` with transformers' fallback where it
is missing). What this module adds is one router, `TopKRouter`, installed in place of the family's
(`install_routers`): the same parameter (``weight`` [experts, hidden]) and the same math (softmax in float32,
top-k, ``norm_topk_prob``), plus what training needs and HF's router lacks. While a `RoutingRecord` is open on
the model (`record_routing`) each router keeps its router logits and its chosen experts, so the actor can add the
load-balancing loss (`load_balancing_loss`, HF's ``load_balancing_loss_func`` over the tokens it is given) and
log the expert load, without asking HF's forward for ``output_router_logits``; given a `Replay` (the experts the
rollout engine chose), the routers route those tokens to them (routing replay) and count how often they agree.

Also here: the active-weight count FLOPs use, the dry run's traceable stand-in for the experts, and the map from
per-expert checkpoint tensors to the stacked weights. Expert parallelism is `models.expert_parallel`.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# model_type -> the class name of the family's router that `TopKRouter` replaces.
MOE_ROUTERS = {"qwen3_moe": "Qwen3MoeTopKRouter"}
MOE_MODEL_TYPES = tuple(MOE_ROUTERS)


def is_moe(config) -> bool:
    return getattr(config, "model_type", None) in MOE_ROUTERS


@dataclass(frozen=True)
class MoETraining:
    """A mixture-of-experts policy's router terms and where its routes come from (the actor's ``moe`` section).

    ``aux_loss_coef``: this times the load-balancing loss (`load_balancing_loss`); 0 adds none.
    ``z_loss_coef``: this times ST-MoE's router z-loss (`router_z_loss`); 0 adds none.
    ``router_replay``: ``"rollout"`` routes each response token to the experts the rollout engine chose for it;
    ``"off"``: the actor routes by itself.
    """

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    router_replay: str = "off"

    def __post_init__(self) -> None:
        if self.router_replay not in ("off", "rollout"):
            raise ValueError(f"router_replay: 'off' or 'rollout', got {self.router_replay!r}")
        for key in ("aux_loss_coef", "z_loss_coef"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")

    @property
    def asked(self) -> list[str]:
        """The keys set to something only a mixture-of-experts policy can do."""
        return [key for key, on in (("aux_loss_coef", bool(self.aux_loss_coef)), ("z_loss_coef", bool(self.z_loss_coef)),
                                    ("router_replay", self.router_replay == "rollout")) if on]


@dataclass
class Replay:
    """Experts recorded for a forward's tokens (by the rollout engine): ``experts`` [layers, tokens, top_k] in the
    forward's token order (rows flattened), valid where ``mask`` [tokens] is True. ``force``: route those tokens
    to them (routing replay); otherwise they are only compared with the router's own choices."""

    experts: torch.Tensor
    mask: torch.Tensor
    force: bool = True


@dataclass
class RoutingRecord:
    """The router logits [tokens, experts] and chosen experts [tokens, top_k] of every MoE layer, in call order,
    for the forwards run while it is open; with ``replay``, the replayed choices, and how many of them the
    router's own top-k also picks (``agreed`` of ``replayed`` token-layer-expert choices)."""

    logits: list[torch.Tensor] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)
    replay: Replay | None = None
    agreed: float = 0.0
    replayed: float = 0.0

    @property
    def agreement(self) -> float:
        """The fraction of replayed choices the router would have made itself (1.0 with nothing replayed)."""
        return self.agreed / self.replayed if self.replayed else 1.0


class TopKRouter(nn.Module):
    """Softmax over the experts, the top-k of them, their probabilities renormalised with ``norm_topk_prob``.

    Returns ``(router_logits, weights, experts)`` as the family's router does, so its sparse block runs unchanged.
    """

    def __init__(self, weight: nn.Parameter, top_k: int, norm_topk_prob: bool, layer: int) -> None:
        super().__init__()
        self.weight = weight  # [experts, hidden]: the replaced router's own parameter
        self.top_k, self.norm_topk_prob, self.layer = top_k, norm_topk_prob, layer  # layer: among the MoE layers
        self.num_experts = weight.shape[0]
        self.record: RoutingRecord | None = None

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        experts = torch.topk(probs, self.top_k, dim=-1).indices
        record = self.record
        if record is not None and record.replay is not None:
            # Route the replayed tokens to the recorded experts; their weights still come from this router's
            # probabilities, so the router keeps its gradient.
            forced, mask = record.replay.experts[self.layer].to(experts.device), record.replay.mask.to(experts.device)
            with torch.no_grad():
                agreed = (forced[:, :, None] == experts[:, None, :]).any(-1) & mask[:, None]
                record.agreed += float(agreed.sum())
                record.replayed += float(mask.sum()) * self.top_k
            if record.replay.force:
                experts = torch.where(mask[:, None], forced.to(experts.dtype), experts)
        top = probs.gather(-1, experts)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        if record is not None:
            record.logits.append(logits)
            record.experts.append(experts)
        return logits, top.to(logits.dtype), experts

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, top_k={self.top_k}, norm_topk_prob={self.norm_topk_prob}"


def install_routers(model: nn.Module) -> int:
    """Replace the family's routers by `TopKRouter` (same parameter, same name), in place; returns how many.

    Call it before sharding or loading: the parameter object moves over, so names and FQNs do not change.
    """
    config = getattr(model, "config", None)
    cls_name = MOE_ROUTERS.get(getattr(config, "model_type", None))
    if cls_name is None:
        return 0
    count = 0
    for module in list(model.modules()):
        gate = getattr(module, "gate", None)
        if gate is not None and type(gate).__name__ == cls_name:
            module.gate = TopKRouter(gate.weight, gate.top_k, gate.norm_topk_prob, layer=count)
            count += 1
    return count


def routers(model: nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@contextlib.contextmanager
def record_routing(model: nn.Module, replay: Replay | None = None) -> Iterator[RoutingRecord]:
    """Keep every router's logits and choices for the forwards run inside the block (one record, layers in
    call order: a forward appends one entry per MoE layer). With ``replay``, route one forward's tokens to its
    experts (`Replay`)."""
    record = RoutingRecord(replay=replay)
    found = routers(model)
    for r in found:
        r.record = record
    try:
        yield record
    finally:
        for r in found:
            r.record = None


def load_balancing_loss(record: RoutingRecord, num_experts: int, token_weights: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers' ``load_balancing_loss_func`` computes it.

    Over all layers' tokens together: ``num_experts * sum_e f_e * P_e``, with ``f_e`` the weighted share of top-k
    choices that went to expert e and ``P_e`` its weighted mean router probability. ``token_weights`` [tokens]
    (the flattened attention mask in HF; 0 drops a padding token, and a count > 1 counts a token shared by that
    many sequences that many times) applies to every layer's rows; None counts every token once.
    """
    counts = torch.zeros(num_experts, dtype=torch.float32, device=record.logits[0].device)
    prob_sum = torch.zeros_like(counts)
    rows = torch.zeros((), dtype=torch.float32, device=counts.device)
    for logits, experts in zip(record.logits, record.experts, strict=True):
        probs = torch.softmax(logits.float(), dim=-1)
        w = (torch.ones(logits.shape[0], device=counts.device) if token_weights is None
             else token_weights.to(device=counts.device, dtype=torch.float32).reshape(-1))
        counts = counts.index_add(0, experts.reshape(-1), w.repeat_interleave(experts.shape[-1]))
        prob_sum = prob_sum + (probs * w[:, None]).sum(0)
        rows = rows + w.sum()
    return num_experts * torch.sum((counts / rows) * (prob_sum / rows))


def router_z_loss(record: RoutingRecord, token_weights: torch.Tensor | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss as transformers' ``router_z_loss_func`` computes it: the mean over all layers'
    tokens of ``logsumexp(router logits)**2``. It keeps the router's logits small, where a low-precision router
    flips fewer routes. ``token_weights`` as in `load_balancing_loss`."""
    total = torch.zeros((), dtype=torch.float32, device=record.logits[0].device)
    rows = torch.zeros_like(total)
    for logits in record.logits:
        w = (torch.ones(logits.shape[0], device=total.device) if token_weights is None
             else token_weights.to(device=total.device, dtype=torch.float32).reshape(-1))
        total = total + (torch.logsumexp(logits.float(), dim=-1) ** 2 * w).sum()
        rows = rows + w.sum()
    return total / rows


def expert_load(record: RoutingRecord, num_experts: int) -> torch.Tensor:
    """Top-k choices per expert, summed over layers and tokens [experts] (for ``moe/expert_load/max_over_mean``)."""
    load = torch.zeros(num_experts, dtype=torch.float32)
    for experts in record.experts:
        load += torch.bincount(experts.reshape(-1).cpu(), minlength=num_experts).float()
    return load


def _experts_stand_in(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """The tensors a grouped-GEMM expert pass allocates ([tokens x top_k] rows through gate/up, the activation and
    down; a gradient for the whole expert weights), computed as if every row went to expert 0: no data-dependent
    shapes, so fake tensors trace it forward and backward."""
    k = top_k_index.shape[-1]
    x = hidden_states.repeat_interleave(k, dim=0)
    gate, up = F.linear(x, experts.gate_up_proj[0]).chunk(2, dim=-1)
    out = F.linear(experts.act_fn(gate) * up, experts.down_proj[0])
    return (out.view(-1, k, out.shape[-1]) * top_k_weights[..., None]).sum(1)


def sparse_blocks(module: nn.Module) -> Iterator[tuple[TopKRouter, nn.Module]]:
    """Each mixture-of-experts block's (router, experts) under ``module``, in module order."""
    for m in module.modules():
        gate, experts = getattr(m, "gate", None), getattr(m, "experts", None)
        if isinstance(gate, TopKRouter) and experts is not None:
            yield gate, experts


@contextlib.contextmanager
def traceable_experts(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s experts run `_experts_stand_in`: for the dry run's fake-tensor memory trace only.

    Why: the grouped GEMM cannot be traced on fake tensors: ``torch._grouped_mm``'s meta kernel takes bfloat16
    only (its CUDA kernel's rule; the CPU kernel runs float32), and transformers' fallback loops over the experts'
    row counts, which fake tensors do not have. The stand-in allocates what the grouped GEMM does.
    """
    patched = [experts for _, experts in sparse_blocks(model)]
    for experts in patched:
        experts.forward = functools.partial(_experts_stand_in, experts)
    try:
        yield
    finally:
        for experts in patched:
            del experts.forward


def active_expert_params(module: nn.Module) -> int:
    """The MoE weights one token multiplies under ``module``: per sparse block, the router and ``top_k`` experts'
    projections (`utils.flops` counts these, not all experts: FLOPs and MFU follow the active parameters)."""
    n = 0
    for gate, experts in sparse_blocks(module):
        per_expert = sum(p.numel() // p.shape[0] for p in experts.parameters(recurse=False))
        n += gate.weight.numel() + gate.top_k * per_expert
    return n


def expert_weights(module: nn.Module) -> int:
    """Every routed expert's weights under ``module`` (all experts, not the active ones): what expert
    parallelism splits and what a decode step reads of the experts its tokens were routed to."""
    return sum(p.numel() for _, experts in sparse_blocks(module) for p in experts.parameters(recurse=False))


# ---------------------------------------------------------------------- checkpoint layout
# HF checkpoints store each expert's projections as tensors of their own; the model holds them stacked
# (transformers converts at `from_pretrained`). The sharded loader reads the stacked names through this map.
_PER_EXPERT = re.compile(r"^(?P<base>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def stacked_expert_sources(keys: Iterable[str]) -> dict[str, list[list[str]]]:
    """The model's stacked expert parameters that per-expert checkpoint ``keys`` make: name -> one list of
    checkpoint tensors per expert, concatenated on dim 0 (``gate_up_proj`` = gate then up) and stacked over experts.
    Raises if an expert is missing (a checkpoint whose expert count disagrees with itself)."""
    found: dict[tuple[str, str], dict[int, str]] = {}
    for key in keys:
        m = _PER_EXPERT.match(key)
        if m:
            found.setdefault((m["base"], m["proj"]), {})[int(m["e"])] = key
    out: dict[str, list[list[str]]] = {}
    for (base, proj), by_expert in found.items():
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"checkpoint experts of {base}.*.{proj}: found {sorted(by_expert)}, not 0..N-1")
        if proj == "down_proj":
            out[f"{base}.down_proj"] = [[by_expert[e]] for e in sorted(by_expert)]
        elif proj == "gate_proj":
            ups = found.get((base, "up_proj"), {})
            if sorted(ups) != sorted(by_expert):
                raise ValueError(f"checkpoint experts of {base}: gate_proj for {sorted(by_expert)}, "
                                 f"up_proj for {sorted(ups)}")
            out[f"{base}.gate_up_proj"] = [[by_expert[e], ups[e]] for e in sorted(by_expert)]
    return out
