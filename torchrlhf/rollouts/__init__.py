"""The rollout path: the one interface the trainer takes scored batches from, and its schedules.

    source = SyncRollouts(pipeline, replicas, prompts)          # or StreamRollouts / DeterministicRollouts
    source.start(version)
    batch, metrics = source.next_batch(step, version)           # generated, scored, filtered, versioned
    metrics |= source.publish(new_version)                      # weights to rollout ranks of their own

`RolloutPipeline` is what every rollout does (generate, ReMax's greedy pass, scoring, DAPO's group filter),
`Replicas` where it runs (every replica, or one; a lost replica given up once, the same way everywhere),
`Repack` the stream schedule's long-tail samples moved to a few replicas (Laminar's dynamic repack).
"""

from torchrlhf.rollouts.background import DeterministicRollouts, StreamRollouts
from torchrlhf.rollouts.pipeline import GroupFilter, RolloutPipeline, Scorer
from torchrlhf.rollouts.repack import Repack
from torchrlhf.rollouts.replicas import Replicas
from torchrlhf.rollouts.source import RolloutSource, SyncRollouts, staleness_metrics
from torchrlhf.rollouts.weight_sync import WeightSync

__all__ = [
    "DeterministicRollouts",
    "GroupFilter",
    "Repack",
    "Replicas",
    "RolloutPipeline",
    "RolloutSource",
    "Scorer",
    "StreamRollouts",
    "SyncRollouts",
    "WeightSync",
    "staleness_metrics",
]
