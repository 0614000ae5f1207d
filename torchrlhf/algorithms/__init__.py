"""Pure tensor maths of the RL algorithms: advantages, policy/value losses, KL, aggregation, Safe-RLHF, DAPO,
on-policy distillation."""

from torchrlhf.algorithms.advantages import ADV_ESTIMATORS, compute_advantage, group_ids
from torchrlhf.algorithms.aggregation import AGG_MODES, agg_loss
from torchrlhf.algorithms.dapo import FilterGroups, OverlongBuffer, filter_groups, overlong_penalty
from torchrlhf.algorithms.distill import distill_advantages, reverse_kl_advantage
from torchrlhf.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    KLControl,
    apply_kl_penalty,
    kl_penalty,
)
from torchrlhf.algorithms.logprob import log_probs_from_hidden
from torchrlhf.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from torchrlhf.algorithms.policy_loss import POLICY_LOSSES, PolicyLoss, compute_policy_loss
from torchrlhf.algorithms.registry import Registry
from torchrlhf.algorithms.rollout_is import ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES, rollout_is_weights
from torchrlhf.algorithms.safe_rlhf import LagrangeMultiplier, Lagrangian, combine_safe_advantages
from torchrlhf.algorithms.value_loss import ValueLoss, compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "AGG_MODES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "AdaptiveKLController",
    "FilterGroups",
    "FixedKLController",
    "KLControl",
    "LagrangeMultiplier",
    "Lagrangian",
    "OverlongBuffer",
    "PolicyLoss",
    "Registry",
    "ValueLoss",
    "agg_loss",
    "apply_kl_penalty",
    "combine_safe_advantages",
    "compute_advantage",
    "compute_policy_loss",
    "compute_value_loss",
    "distill_advantages",
    "filter_groups",
    "group_ids",
    "kl_penalty",
    "log_probs_from_hidden",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "overlong_penalty",
    "reverse_kl_advantage",
    "rollout_is_weights",
]
