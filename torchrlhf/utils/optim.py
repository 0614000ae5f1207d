"""AdamW and the warmup learning-rate schedule shared by the trainable workers."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (FSDP2 shards are DTensors; AdamW updates them shard-locally).

    The fused kernel where the parameters' device has one (CPU and CUDA): on this project's 2-core
    CPU it steps SmolLM2-135M in 0.045 s against 0.71-0.78 s for the default multi-tensor loop.
    """
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params) or None
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=tuple(betas), eps=eps, fused=fused)


def warmup_lambda(step: int, *, warmup_steps: int, total_steps: int, style: str, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer-schedule ``step``: linear warmup, then constant or cosine decay to ``min_lr_ratio``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if style == "constant":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    style: str = "constant",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A LambdaLR stepped once per training iteration (one `update` call), as the trainer counts steps."""
    if style not in ("constant", "cosine"):
        raise ValueError(f"lr_scheduler style must be 'constant' or 'cosine', got {style!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if style == "cosine" and not total_steps:
        raise ValueError("the cosine lr schedule needs total_steps > 0")
    total = total_steps or 0
    return LambdaLR(
        optimizer,
        lambda step: warmup_lambda(
            step, warmup_steps=warmup_steps, total_steps=total, style=style, min_lr_ratio=min_lr_ratio
        ),
    )
