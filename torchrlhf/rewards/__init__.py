"""Rule rewards (GSM8K, math, countdown, arithmetic, calculator agent), user reward functions and `RewardManager`."""

from torchrlhf.rewards.manager import RewardManager
from torchrlhf.rewards.registry import REWARD_FUNCTIONS, get_reward_fn, load_reward_fn

__all__ = ["REWARD_FUNCTIONS", "RewardManager", "get_reward_fn", "load_reward_fn"]
