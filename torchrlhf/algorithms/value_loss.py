"""Clipped value-function loss (PPO critic)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrlhf.algorithms.aggregation import AGG_MODES, agg_loss
from torchrlhf.algorithms.masked import masked_mean


def compute_value_loss(
    vpreds: torch.Tensor,
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0.5 * agg(max((v - R)^2, (clip(v, v_old ± c) - R)^2)); the max keeps the critic from moving far from
    the rollout values in one update. ``cliprange_value=None`` disables clipping. Returns (loss, vf_clipfrac)."""
    losses1 = (vpreds - returns) ** 2
    if cliprange_value is None:
        losses2 = losses1
    else:
        clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
        losses2 = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(losses1, losses2), response_mask, loss_agg_mode, normalizer=normalizer)
    vf_clipfrac = masked_mean((losses2 > losses1).float(), response_mask.float()).detach()
    return loss, vf_clipfrac


@dataclass(frozen=True)
class ValueLoss:
    """The ``critic.loss`` section: the value prediction is clipped to ``cliprange_value`` around the rollout's
    values (None: unclipped), the per-token losses aggregated by ``agg_mode`` (`AGG_MODES`)."""

    cliprange_value: float | None = 0.5
    agg_mode: str = "token-mean"

    def __post_init__(self) -> None:
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode: unknown {self.agg_mode!r}; valid: {list(AGG_MODES)}")
        if self.cliprange_value is not None and not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value: must be positive (or null: unclipped), got {self.cliprange_value}")

