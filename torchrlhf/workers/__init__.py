"""SPMD roles driven by the controller: policy/reference, critic, reward/cost model."""

from torchrlhf.workers.actor import ActorWorker
from torchrlhf.workers.critic import CriticWorker
from torchrlhf.workers.microbatch import validate_batch_sizes
from torchrlhf.workers.reward_model import RewardModelWorker

__all__ = ["ActorWorker", "CriticWorker", "RewardModelWorker", "validate_batch_sizes"]
