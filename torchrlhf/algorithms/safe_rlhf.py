"""Safe-RLHF: a Lagrange multiplier trades reward against a cost constraint E[cost] <= threshold."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


class LagrangeMultiplier:
    """Projected gradient ascent on lambda: lambda <- clamp(lambda + lr * (mean_cost - threshold), 0, max_value).
    Lambda grows while the constraint is violated and decays to 0 once it holds."""

    def __init__(self, init: float, lr: float, threshold: float, max_value: float | None = None):
        if init < 0:
            raise ValueError(f"LagrangeMultiplier: init must be >= 0, got {init}")
        self.value, self.lr, self.threshold, self.max_value = float(init), float(lr), float(threshold), max_value

    def update(self, mean_cost: float | torch.Tensor) -> float:
        value = max(0.0, self.value + self.lr * (float(mean_cost) - self.threshold))
        self.value = value if self.max_value is None else min(value, float(self.max_value))
        return self.value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


@dataclass(frozen=True)
class Lagrangian:
    """The ``algorithm.lagrangian`` section (Safe-RLHF, used when a ``cost_model`` is configured): the
    `LagrangeMultiplier`'s arguments. lambda starts at ``init`` and moves by ``lr`` times the batch's mean cost
    minus ``threshold`` (the cost the constraint allows), clamped to [0, ``max_value``] (None: no upper bound)."""

    init: float = 1.0
    lr: float = 0.05
    threshold: float = 0.0
    max_value: float | None = None

    def __post_init__(self) -> None:
        if not self.init >= 0:
            raise ValueError(f"init: must be >= 0, got {self.init}")
        if not self.lr >= 0:
            raise ValueError(f"lr: must be >= 0, got {self.lr}")
        if self.max_value is not None and not self.max_value >= 0:
            raise ValueError(f"max_value: must be >= 0 or null, got {self.max_value}")

    def multiplier(self) -> LagrangeMultiplier:
        """A new `LagrangeMultiplier` at ``init``."""
        return LagrangeMultiplier(**asdict(self))


def combine_safe_advantages(
    reward_adv: torch.Tensor, cost_adv: torch.Tensor, lam: float | torch.Tensor
) -> torch.Tensor:
    """(A_r - lambda * A_c) / (1 + lambda): dividing by 1 + lambda keeps the advantage scale bounded as lambda grows."""
    return (reward_adv - lam * cost_adv) / (1 + lam)
