"""SPMD roles driven by the controller: policy/reference, critic, reward/cost model, LLM judge."""

from torchrlhf.workers.actor import ActorWorker
from torchrlhf.workers.critic import CriticWorker
from torchrlhf.workers.judge import JudgeWorker
from torchrlhf.workers.base import MemorySaving, TrainingRun
from torchrlhf.workers.microbatch import Batching, validate_batch_sizes
from torchrlhf.workers.reward_model import RewardModelWorker
from torchrlhf.workers.rollout import RolloutWorker

__all__ = ["ActorWorker", "Batching", "CriticWorker", "JudgeWorker", "MemorySaving", "RewardModelWorker", "RolloutWorker",
           "TrainingRun", "validate_batch_sizes"]
