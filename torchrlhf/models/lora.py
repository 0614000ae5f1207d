"""LoRA adapters on a frozen causal LM, under the model's own parameter names.

`inject_lora` swaps each targeted ``nn.Linear`` for a `LoRALinear`: the same module (it *is* an
``nn.Linear``, with the same ``weight`` Parameter, now frozen) plus two trainable factors ``lora_A``
``[r, in]`` and ``lora_B`` ``[out, r]``:

    y = x W^T + b + (alpha / r) · (x A^T) B^T

Why not PEFT's layers: they move the base weight to ``<module>.base_layer.weight`` and are not
``nn.Linear``, so the HF names that the sharded loader, the weight streams, the engines and the
checkpoints all key on would change, and PyTorch's tensor-parallel styles refuse them. Here every base
name stays the HF name, the adapters add ``<module>.lora_A`` / ``<module>.lora_B``, and the TP plan
shards them with `lora_tp_style` (one all-reduce per row-parallel layer, shared with the base). PEFT's
file format is what `peft_state_dict` writes, and the initialisation is PEFT's (A Kaiming-uniform,
B zero), drawn per module name so it is the same on any number of ranks.

Merging is out of place (`merged_weight`): the training model is never merged and unmerged.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

ALL_LINEAR = "all-linear"
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


@dataclass(frozen=True)
class LoRAConfig:
    """The ``actor.lora`` section.

    ``target_modules``: ``"all-linear"`` (every Linear of the decoder blocks, not the output head),
    a list of module names matched as name suffixes (``[q_proj, v_proj]``), or another string read as
    a regular expression over the full module names (as PEFT reads a string).
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | list[str] = field(default=ALL_LINEAR)

    def __post_init__(self) -> None:
        if self.rank <= 0:
            raise ValueError(f"rank: must be a positive integer, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"alpha: must be positive, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ValueError("target_modules: must name at least one module (or be 'all-linear')")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, value: LoRAConfig | Mapping | None) -> LoRAConfig | None:
        """A config from a section (dict) or itself; None stays None (no LoRA)."""
        return value if value is None or isinstance(value, cls) else cls(**value)


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (see the module docstring).

    The adapter parameters are registered before the base ones, so a parameter stream (weight sync,
    generation) delivers a module's small factors first and can merge as soon as its weight arrives.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 adapter_dtype: torch.dtype = torch.float32) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        device = base.weight.device
        self.lora_A = nn.Parameter(torch.zeros(rank, self.in_features, device=device, dtype=adapter_dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=adapter_dtype))
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.scaling, self.dropout = rank, alpha / rank, dropout
        self.adapter_enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, x.shape[-1])
        out = F.linear(rows, self.weight, self.bias)
        h = F.dropout(rows, self.dropout, self.training) if self.dropout else rows
        low = F.linear(h, self.lora_A).to(out.dtype)
        # s · (h Aᵀ) Bᵀ accumulates into the base product in place: the rank-r GEMM writes no activation-sized
        # temporary and needs no separate add (on CPU this is most of an adapter's cost).
        out.addmm_(low, self.lora_B.to(out.dtype).t(), alpha=self.scaling)
        return out.view(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


# ---------------------------------------------------------------------- which modules
def _candidates(model: nn.Module) -> dict[str, nn.Module]:
    """Every module LoRA could target: all named modules except the output head (and the model itself)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return {name: m for name, m in model.named_modules() if name and m is not head}


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def target_module_names(model: nn.Module, target_modules: str | Iterable[str]) -> list[str]:
    """Full names of the Linear modules ``target_modules`` selects (PEFT's rules; see `LoRAConfig`).

    Raises ValueError when the selection is empty, or names a module that is not a Linear (LoRA wraps
    Linear layers only; the output head and the embeddings are not targets here).
    """
    candidates = _candidates(model)
    if target_modules == ALL_LINEAR:
        blocks = [n for n, m in candidates.items() if _is_linear(m) and ".layers." in f".{n}"]
        names = blocks or [n for n, m in candidates.items() if _is_linear(m)]
    elif isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        names = [n for n in candidates if pattern.fullmatch(n)]
    else:
        wanted = list(target_modules)
        names = [n for n in candidates if any(n == t or n.endswith(f".{t}") for t in wanted)]
        unmatched = [t for t in wanted if not any(n == t or n.endswith(f".{t}") for n in names)]
        if unmatched:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in candidates.items() if _is_linear(m)})
            raise ValueError(f"{unmatched} match no module of {type(model).__name__}; "
                             f"its Linear layers are named {linear} (or use 'all-linear')")
    if not names:
        raise ValueError(f"{target_modules!r} matches no module of {type(model).__name__}")
    not_linear = [n for n in names if not _is_linear(candidates[n])]
    if not_linear:
        raise ValueError(f"{not_linear[:3]} ({type(candidates[not_linear[0]]).__name__}) selected: "
                         "LoRA wraps nn.Linear layers only")
    return names


def inject_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Wrap the targeted Linear layers of ``model`` in `LoRALinear` (in place; meta or real) and freeze
    everything but the adapters. Returns the wrapped modules' names. The adapters start at zero: call
    `init_lora` once the model has its real storage."""
    names = target_module_names(model, config.target_modules)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(getattr(parent, child), config.rank, config.alpha, config.dropout))
    for pname, p in model.named_parameters():
        p.requires_grad_(is_adapter(pname))
    return names


def hold_frozen_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Store every frozen parameter in ``dtype`` (meta or real): a frozen base needs no float32 master
    copy when it computes in a lower precision anyway (FSDP2's ``param_dtype``); the adapters keep theirs."""
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA factor."""
    return name.endswith(ADAPTER_SUFFIXES)


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def module_scalings(model: nn.Module) -> dict[str, float]:
    """``<module>.weight`` -> its adapter's scaling, for every LoRA module (what a merge needs)."""
    return {f"{name}.weight": m.scaling for name, m in lora_modules(model).items()}


def lora_init_tensors(model: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """PEFT's initial adapters as full tensors by parameter name: ``lora_A`` Kaiming-uniform (a=√5),
    ``lora_B`` zero, so training starts at the base model. Each module's draw depends only on ``seed`` and
    its name: every rank, sharded or not, computes the same adapters."""
    out = {}
    for name, m in lora_modules(model).items():
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        a = torch.empty(tuple(m.lora_A.shape), dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
        out[f"{name}.lora_A"] = a.to(m.lora_A.dtype)
        out[f"{name}.lora_B"] = torch.zeros(tuple(m.lora_B.shape), dtype=m.lora_B.dtype)
    return out


def init_lora(model: nn.Module, seed: int = 0) -> None:
    """Fill the adapters of an unsharded model with real storage with `lora_init_tensors`. (A sharded
    model built on meta gets them as it loads: ``load_weights(..., extra=lora_init_tensors(model, seed))``.)"""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in lora_init_tensors(model, seed).items():
            if isinstance(params[name], DTensor) or params[name].is_meta:
                raise ValueError(f"init_lora fills unsharded storage; {name} is sharded or on meta "
                                 "(load it with load_weights(..., extra=lora_init_tensors(model, seed)))")
            params[name].copy_(full)


@contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes as its frozen base: the reference policy of a LoRA actor."""
    modules = list(lora_modules(model).values())
    for m in modules:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.adapter_enabled = True


# ---------------------------------------------------------------------- tensor parallelism
class _LoRAColwise(ColwiseParallel):
    """Column-parallel LoRA Linear: W and B split by output rows, A replicated (the input is)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Replicate() if pname == "lora_A" else Shard(0)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))


class _LoRARowwise(RowwiseParallel):
    """Row-parallel LoRA Linear: W and A split by input columns, B replicated. Both products are
    partial sums, added before the one all-reduce of the layer's output."""

    def _partition_linear_fn(self, name, module, device_mesh):
        super()._partition_linear_fn(name, module, device_mesh)
        module.register_parameter("lora_A", nn.Parameter(
            distribute_tensor(module.lora_A, device_mesh, [Shard(1)], src_data_rank=self.src_data_rank),
            requires_grad=module.lora_A.requires_grad))
        module.register_parameter("lora_B", nn.Parameter(
            distribute_tensor(module.lora_B, device_mesh, [Replicate()], src_data_rank=self.src_data_rank),
            requires_grad=module.lora_B.requires_grad))


def lora_tp_style(module: nn.Module, style: type) -> type:
    """The TP style for ``module`` under the block plan's ``style``: LoRA-aware for a `LoRALinear`."""
    if not isinstance(module, LoRALinear):
        return style
    if style is ColwiseParallel:
        return _LoRAColwise
    if style is RowwiseParallel:
        return _LoRARowwise
    raise ValueError(f"no tensor-parallel LoRA style for {style.__name__}")


def adapter_shard_dims(weight_dims: Mapping[str, int | None]) -> dict[str, int | None]:
    """Generation-layout TP dims of every possible adapter factor, from the dims of the engine's weights.

    A column-parallel weight (dim 0) splits B by rows and replicates A; a row-parallel one (dim 1) splits
    A by columns and replicates B. Then each rank's merged shard is ``W_local + s · B_local @ A_local``.
    """
    dims: dict[str, int | None] = {}
    for name, dim in weight_dims.items():
        if not name.endswith(".weight"):
            continue
        module = name[: -len(".weight")]
        dims[f"{module}.lora_A"] = 1 if dim == 1 else None
        dims[f"{module}.lora_B"] = 0 if dim == 0 else None
    return dims


# ---------------------------------------------------------------------- merging
def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + s · B @ A`` as a new tensor in ``weight``'s dtype (computed in float32 when W is lower)."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    out = torch.addmm(weight.to(dtype), lora_b.to(dtype), lora_a.to(dtype), alpha=scaling)
    return out.to(weight.dtype)


def merge_stream(named: Iterable[tuple[str, torch.Tensor]], scalings: Mapping[str, float]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """A parameter stream with the adapters folded in: ``<m>.lora_A`` / ``<m>.lora_B`` are held (they come
    first, see `LoRALinear`) and ``<m>.weight`` is yielded merged; everything else passes through.

    ``scalings`` maps ``<m>.weight`` to its adapter's scaling (`module_scalings`). Tensors may be local
    shards in the generation layout (`adapter_shard_dims`). A weight whose factors did not come first is
    an error, never a silent base weight.
    """
    factors: dict[str, torch.Tensor] = {}
    for name, tensor in named:
        if is_adapter(name):
            factors[name] = tensor.clone()  # the stream may reuse its buffer for the next tensor
            continue
        if name in scalings:
            module = name[: -len(".weight")]
            a, b = factors.pop(f"{module}.lora_A", None), factors.pop(f"{module}.lora_B", None)
            if a is None or b is None:
                raise RuntimeError(f"merge_stream: {name} arrived without its adapter factors")
            yield name, merged_weight(tensor, a, b, scalings[name])
            continue
        yield name, tensor
    if factors:
        raise RuntimeError(f"merge_stream: adapter factors without their weight: {sorted(factors)[:4]}")


# ---------------------------------------------------------------------- PEFT's format
PEFT_PREFIX = "base_model.model."


def peft_key(name: str) -> str:
    """Our adapter name -> PEFT's saved key (``...q_proj.lora_A`` -> ``base_model.model...q_proj.lora_A.weight``)."""
    return f"{PEFT_PREFIX}{name}.weight"


def peft_adapter_config(config: LoRAConfig, modules: Iterable[str], base_model: str) -> dict:
    """``adapter_config.json`` for PEFT: the exact module names wrapped (a regex PEFT matches in full)."""
    names = sorted(set(modules))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": "^(" + "|".join(re.escape(n) for n in names) + ")$",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def adapter_modules(names: Iterable[str]) -> list[str]:
    """The module names behind adapter parameter names."""
    return sorted({n.rsplit(".", 1)[0] for n in names if is_adapter(n)})

