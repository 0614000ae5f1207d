"""Importance weights that correct for sampling with a policy other than the one being trained.

The engine that generated a rollout is never exactly the policy the loss differentiates: it runs in
another dtype or kernel (bf16 rollouts, vLLM) and, when rollouts run ahead of training, with older
weights. PPO's ratio is taken against the *old* (proximal) policy, so the rollout's own per-token
log-probs enter only through a second, detached weight

    rho_t = pi_old(y_t) / pi_rollout(y_t)

(decoupled PPO). Used raw, rho has unbounded variance, so it is bounded:

- ``truncate`` (TIS): ``min(rho, threshold)``;
- ``mask`` (MIS): ``rho`` where ``rho <= threshold``, else 0 — the token (or sequence) is dropped.

At ``sequence`` level rho is the product over the response's tokens and every token of a response
gets its sequence's weight.
"""

from __future__ import annotations

import math

import torch

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("truncate", "mask")


def check_rollout_is(level: str | None, mode: str, threshold: float) -> None:
    """ValueError naming the bad setting (``level`` None means off)."""
    if level is not None and level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is: must be one of {ROLLOUT_IS_LEVELS} or null, got {level!r}")
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is_mode: must be one of {ROLLOUT_IS_MODES}, got {mode!r}")
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold: must be positive, got {threshold}")


def rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    threshold: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bounded weights ``[B, R]`` (0 on padding) and the raw ratios ``[B, R]`` they came from, both detached.

    Log-ratios are summed (sequence level) and compared in log space, so a long response's product
    never overflows.
    """
    check_rollout_is(level, mode, threshold)
    mask = response_mask.to(torch.float32)
    log_rho = (old_log_probs.detach().float() - rollout_log_probs.detach().float()) * mask
    if level == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(mask)
    log_threshold = math.log(threshold)
    raw = torch.exp(log_rho.clamp(max=80.0))
    if mode == "truncate":
        weights = torch.exp(log_rho.clamp(max=log_threshold))
    else:
        weights = torch.where(log_rho <= log_threshold, raw, torch.zeros_like(raw))
    return weights * mask, raw * mask
