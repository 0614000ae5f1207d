"""KL estimators between the policy and the reference, and the KL-in-reward controllers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from torchrlhf.algorithms.masked import masked_mean

_BASE_KINDS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
KL_KINDS = _BASE_KINDS + tuple(k + "+" for k in _BASE_KINDS)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (Schulman's k1/k2/k3). ``k3``/``low_var_kl`` is clamped to [-10, 10] with its
    log-ratio clamped to [-20, 20]. A trailing ``+`` is straight-through: the value of the base kind with the
    gradient of k2 (an unbiased KL gradient, unlike k1/k3's)."""
    if kind.endswith("+"):
        if kind not in KL_KINDS:
            raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
        grad_term = kl_penalty(log_prob, ref_log_prob, "k2")
        return grad_term - grad_term.detach() + kl_penalty(log_prob, ref_log_prob, kind[:-1]).detach()
    diff = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = torch.clamp(ref_log_prob - log_prob, -20.0, 20.0)
        return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)
    raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. 2019: move the coefficient towards ``target_kl``; the error is clipped to ±20% and scaled
    by n_steps / horizon, so the coefficient changes by at most a factor (1 ± 0.2·n_steps/horizon) per update."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl and horizon must be > 0, got {target_kl}, {horizon}")
        self.value, self.target, self.horizon = float(init_kl_coef), float(target_kl), horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass(frozen=True)
class KLControl:
    """The ``algorithm.kl_ctrl`` section (verl's ``algorithm.kl_ctrl``): the coefficient of the KL penalty folded
    into the reward (``algorithm.use_kl_in_reward``), checked when it is built.

    ``type: fixed`` keeps ``kl_coef``; ``adaptive`` starts from it and moves it towards ``target_kl``, by at most
    ±20% per ``horizon`` samples (`AdaptiveKLController`).
    """

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000

    def __post_init__(self) -> None:
        if self.type not in ("fixed", "adaptive"):
            raise ValueError(f"type: must be 'fixed' or 'adaptive', got {self.type!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef: must be >= 0, got {self.kl_coef}")
        if self.type == "adaptive" and not self.target_kl > 0:
            raise ValueError(f"target_kl: must be > 0 (type adaptive), got {self.target_kl}")
        if self.type == "adaptive" and not self.horizon > 0:
            raise ValueError(f"horizon: must be > 0 (type adaptive), got {self.horizon}")

    def controller(self) -> FixedKLController | AdaptiveKLController:
        """A new controller at ``kl_coef``."""
        if self.type == "adaptive":
            return AdaptiveKLController(self.kl_coef, self.target_kl, self.horizon)
        return FixedKLController(self.kl_coef)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards = scores - beta * KL per token, beta = ``kl_ctrl.value``. Pure: the controller is NOT updated here
    (verl updates inside); the caller runs ``kl_ctrl.update(metrics["actor/reward_kl_penalty"], n_steps=B)``.
    ``actor/reward_kl_penalty`` is the batch mean of the per-sequence masked-mean KL."""
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind) * mask
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, mask, dim=-1).mean().item()
    if not math.isfinite(current_kl):
        raise ValueError(f"apply_kl_penalty: KL is {current_kl}; check old_log_prob/ref_log_prob")
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
