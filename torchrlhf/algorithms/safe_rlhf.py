"""Safe-RLHF: a Lagrange multiplier trades reward against a cost constraint E[cost] <= threshold."""

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


def combine_safe_advantages(
    reward_adv: torch.Tensor, cost_adv: torch.Tensor, lam: float | torch.Tensor
) -> torch.Tensor:
    """(A_r - lambda * A_c) / (1 + lambda): dividing by 1 + lambda keeps the advantage scale bounded as lambda grows."""
    return (reward_adv - lam * cost_adv) / (1 + lam)
