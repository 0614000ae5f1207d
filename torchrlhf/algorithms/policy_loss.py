"""Policy-gradient losses: (old_log_prob, log_prob, advantages, mask) -> (scalar loss, metrics).

Every loss multiplies the per-token loss by ``tis_weights`` (truncated importance-sampling weights correcting
the rollout/training log-prob mismatch) when given; the weights are treated as constants (stop-gradient).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchrlhf.algorithms.aggregation import AGG_MODES, agg_loss
from torchrlhf.algorithms.masked import masked_mean
from torchrlhf.algorithms.registry import Registry
from torchrlhf.algorithms.rollout_is import check_rollout_is

POLICY_LOSSES = Registry("policy loss")

LOG_RATIO_CLAMP = 20.0


def _log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    # Clamped so exp() cannot overflow when the policies drift far apart.
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _finish(pg_losses, mask, tis_weights, loss_agg_mode, normalizer):
    if tis_weights is not None:
        pg_losses = pg_losses * tis_weights.detach()
    return agg_loss(pg_losses, mask, loss_agg_mode, normalizer=normalizer)


@POLICY_LOSSES.register("ppo", "vanilla")
def ppo_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
             clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tis_weights=None, normalizer=None):
    """PPO clipped surrogate, clip range [1 - low, 1 + high] (DAPO clip-higher), plus dual-clip: for A < 0 the
    loss is capped at -A * clip_ratio_c so a huge ratio on a bad token cannot dominate."""
    if clip_ratio_c <= 1.0:
        raise ValueError(f"ppo: clip_ratio_c must be > 1, got {clip_ratio_c}")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(losses1, losses2)
    losses3 = -advantages * clip_ratio_c
    dual = torch.minimum(clipped, losses3)
    pg_losses = torch.where(advantages < 0, dual, clipped)
    metrics = {
        "pg_clipfrac": masked_mean((losses2 > losses1).float(), mask).detach(),
        "pg_clipfrac_lower": masked_mean(((clipped > losses3) & (advantages < 0)).float(), mask).detach(),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return _finish(pg_losses, mask, tis_weights, loss_agg_mode, normalizer), metrics


@POLICY_LOSSES.register("gspo")
def gspo_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
              clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tis_weights=None, normalizer=None):
    """GSPO: sequence ratio s_i = exp(mean masked log-ratio), clipped like PPO. Token form
    s_i,t = sg[s_i] * pi_t / sg[pi_t] has the value s_i and gradient sg[s_i] * grad log pi_t.
    The GSPO paper aggregates with seq-mean-token-mean (verl forces it); here ``loss_agg_mode`` is honoured."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(losses1, losses2)
    metrics = {
        "pg_clipfrac": masked_mean((losses2 > losses1).float(), mask).detach(),
        "pg_clipfrac_lower": torch.zeros((), dtype=torch.float32),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return _finish(pg_losses, mask, tis_weights, loss_agg_mode, normalizer), metrics


@POLICY_LOSSES.register("cispo")
def cispo_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
               clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tis_weights=None, normalizer=None):
    """CISPO (MiniMax-M1): -sg[clip(ratio, 1 - low, 1 + high)] * A * log pi. Clipping the IS weight instead of
    the update keeps a gradient on every token (PPO zeroes clipped tokens)."""
    mask = response_mask.to(log_prob.dtype)
    log_ratio = _log_ratio(old_log_prob, log_prob)
    ratio = torch.exp(log_ratio).detach()
    weight = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = -advantages * weight * log_prob
    metrics = {
        "pg_clipfrac": masked_mean(((ratio > 1 + clip_ratio_high) | (ratio < 1 - clip_ratio_low)).float(), mask),
        "pg_clipfrac_lower": masked_mean((ratio < 1 - clip_ratio_low).float(), mask),
        "ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    return _finish(pg_losses, mask, tis_weights, loss_agg_mode, normalizer), metrics


@POLICY_LOSSES.register("reinforce")
def reinforce_loss(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode="token-mean",
                   clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, tis_weights=None, normalizer=None):
    """Plain REINFORCE: -A * log pi (no ratio, no clipping; old_log_prob only feeds the ppo_kl metric)."""
    mask = response_mask.to(log_prob.dtype)
    pg_losses = -advantages * log_prob
    zero = torch.zeros((), dtype=torch.float32)
    metrics = {
        "pg_clipfrac": zero,
        "pg_clipfrac_lower": zero.clone(),
        "ppo_kl": masked_mean(-_log_ratio(old_log_prob, log_prob), mask).detach(),
    }
    return _finish(pg_losses, mask, tis_weights, loss_agg_mode, normalizer), metrics


def compute_policy_loss(
    name: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    tis_weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run the policy loss ``name`` (see ``POLICY_LOSSES``).

    Returns (loss, metrics) with metrics {pg_clipfrac, pg_clipfrac_lower, ppo_kl} as detached tensors."""
    fn = POLICY_LOSSES[name]
    for what, t in (("old_log_prob", old_log_prob), ("advantages", advantages), ("response_mask", response_mask)):
        if t.shape != log_prob.shape:
            raise ValueError(
                f"compute_policy_loss({name!r}): {what} {tuple(t.shape)} != log_prob {tuple(log_prob.shape)}"
            )
    return fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode=loss_agg_mode,
              clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
              tis_weights=tis_weights, normalizer=normalizer)


@dataclass(frozen=True)
class PolicyLoss:
    """The ``actor.loss`` section: the policy's training objective, checked when it is built.

    ``policy_loss`` names a `POLICY_LOSSES` entry, clipped by ``clip_ratio_*``; the per-token losses are
    aggregated by ``agg_mode`` (`AGG_MODES`). ``entropy_coeff`` subtracts that much of the entropy; with
    ``use_kl_loss`` the loss adds ``kl_loss_coef`` times the ``kl_loss_type`` estimate of KL(policy || reference)
    (the KL-as-loss form; ``algorithm.use_kl_in_reward`` is the other). ``rollout_is`` ("token" / "sequence",
    off when None) weights each token's loss by the bounded ratio of the old policy to the rollout engine's
    log-probs (`algorithms.rollout_is`; ``rollout_is_mode``, ``rollout_is_threshold``).
    """

    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    rollout_is: str | None = None
    rollout_is_mode: str = "truncate"
    rollout_is_threshold: float = 2.0

    def __post_init__(self) -> None:
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss: unknown {self.policy_loss!r}; valid: {sorted(POLICY_LOSSES)}")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode: unknown {self.agg_mode!r}; valid: {list(AGG_MODES)}")
        check_rollout_is(self.rollout_is, self.rollout_is_mode, self.rollout_is_threshold)

    @property
    def clip(self) -> dict[str, float]:
        """The clip ranges as `compute_policy_loss` takes them."""
        return {"clip_ratio_low": self.clip_ratio_low, "clip_ratio_high": self.clip_ratio_high,
                "clip_ratio_c": self.clip_ratio_c}

    @property
    def rollout_is_args(self) -> dict[str, Any]:
        """The rollout correction as `rollout_is_weights` takes it."""
        return {"level": self.rollout_is, "mode": self.rollout_is_mode, "threshold": self.rollout_is_threshold}

