"""The one interface the trainer takes scored batches from, and the synchronous schedule.

Every schedule is a `RolloutSource`: the trainer asks it for the next batch, tells it when a new weight
version exists (`publish`, which also moves the weights to rollout ranks of their own), generates its
validation through it, pauses it for checkpoints and saves its state. Synchronous rollouts generate on the
trainer's thread with the newest weights (`SyncRollouts`); the asynchronous schedules run ahead on threads
of their own (`torchrlhf.rollouts.background`). What a rollout does is the same for all of them
(`RolloutPipeline`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from torchrlhf.data import Batch
from torchrlhf.generation.sampling import SamplingParams
from torchrlhf.generation.base import concat_generations
from torchrlhf.rollouts.pipeline import RolloutPipeline
from torchrlhf.rollouts.replicas import Replicas
from torchrlhf.utils.timer import timer


class RolloutSource:
    """Scored batches for the trainer, one per step (see the module docstring).

    Args:
        pipeline: what a rollout does (generation, ReMax baseline, scoring, group filter).
        replicas: the rollout group.
        prompts: the training prompts (``next_batch``, resumable).
        weight_sync: rollout ranks of their own: pushes the actor's weights to them (`WeightSync`).
        max_staleness: how many versions a sample may lag the weights it trains (0 when synchronous).
        seed: the training and the validation prompts' sampling seeds (two streams: validation never
            shifts the training samples).
    """

    uses_relay = False  # new weights go into the rollout ranks' relays, read between trajectories

    def __init__(self, pipeline: RolloutPipeline, replicas: Replicas, prompts: Any, *, weight_sync: Any = None,
                 max_staleness: int = 0, seed: int = 0) -> None:
        self.pipeline, self.replicas, self.prompts, self.weight_sync = pipeline, replicas, prompts, weight_sync
        self.batch_size, self.n, self.k = prompts.batch_size, pipeline.sampling.n, max_staleness
        self.generator = torch.Generator().manual_seed(seed)
        self.val_generator = torch.Generator().manual_seed(seed)
        self.published = 0  # the newest weight version the rollout replicas may use
        self._synced = 0  # the version the rollout ranks hold (every engine starts from the model's weights)

    # ------------------------------------------------------------------ the trainer's calls
    def start(self, version: int) -> None:
        """Before the first step (after a resume, ``version`` is the restored one)."""
        self.publish(version)

    def stop(self) -> None:
        """After the last step (or a failure)."""

    def next_batch(self, step: int, version: int) -> tuple[Batch, dict[str, float]]:
        """Fully scored samples of ``data.train_batch_size`` prompt groups for training step ``step``
        (1-based) at weight ``version``, each with its ``weight_version``; and the step's rollout metrics.

        Every schedule hands its samples over here, so the model scores the pipeline left out of the unit
        (an asynchronous run whose reward or cost model shares ranks with the training roles) are added on
        the trainer's thread for every schedule alike."""
        batch, metrics = self._take(step, version)
        return self.pipeline.finish(batch, metrics), metrics

    def _take(self, step: int, version: int) -> tuple[Batch, dict[str, float]]:
        """The schedule's part of `next_batch`: the step's samples as the rollout units scored them."""
        raise NotImplementedError

    def publish(self, version: int) -> dict[str, float]:
        """The trainer's step is done and the actor holds ``version`` (the same as before after a step that
        did not update it). Rollout ranks of their own get the new weights now."""
        metrics: dict[str, float] = {}
        if self.weight_sync is not None and version != self._synced:
            with timer("weight_sync", metrics):
                metrics.update(self.weight_sync(version, to_relay=self.uses_relay))
            self._synced = version
        self._on_publish(version)
        metrics.update(self.replicas.busy_metrics())
        return metrics

    def validation_batch(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """Responses to validation ``prompts`` from the newest published weights."""
        with self.paused():
            prompts = self.pipeline.seeded(prompts, self.val_generator)
            return self.replicas.generate(prompts, sampling, version=self.published)

    @contextlib.contextmanager
    def paused(self, drain: bool = False) -> Iterator[None]:
        """No rollout runs inside (validation, checkpoints). ``drain`` (checkpoints) first finishes what the
        published version allows, so that a checkpoint holds it."""
        yield

    def state_dict(self) -> dict[str, Any]:
        """Call inside `paused`: what a resumed run needs to continue as this one would."""
        return {"generator": self.generator.get_state(), "val_generator": self.val_generator.get_state(),
                "requeued": self.replicas.requeued}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        if "val_generator" in state:
            self.val_generator.set_state(state["val_generator"])
        self.replicas.requeued = state.get("requeued", 0)

    # ------------------------------------------------------------------ shared by the schedules
    def _on_publish(self, version: int) -> None:
        self.published = version

    def _collect_step(self, version: int, timings: dict[str, float] | None = None) -> tuple[Batch, dict[str, float]]:
        """Rollouts for one training step with weight ``version`` on every live replica: one prompt batch,
        or with the group filter as many as it takes for ``batch_size`` groups to train (the rest of the
        last batch is not used)."""
        generate = lambda prompts, sampling: self.replicas.generate(prompts, sampling, version=version)  # noqa: E731
        kept: list[Batch] = []
        metrics: dict[str, float] = {}
        groups = units = filtered = 0
        while groups < self.batch_size:
            units += 1
            prompts = self.pipeline.seeded(self.prompts.next_batch(), self.generator)
            gen, unit_metrics = self.pipeline.run(prompts, generate, timings)
            metrics.update(unit_metrics)
            if self.pipeline.group_filter is None:
                return gen, metrics
            keep = self.pipeline.group_filter.keep(gen)
            filtered += len(keep) - sum(keep)
            self.pipeline.group_filter.check(filtered)
            kept.append(gen[torch.tensor(keep).repeat_interleave(self.n)])
            groups += sum(keep)
        metrics["train/num_gen_batches"] = float(units)
        metrics["train/dropped_groups"] = float(filtered)
        return concat_generations(kept, self.replicas.pad_id)[: self.batch_size * self.n], metrics


class SyncRollouts(RolloutSource):
    """Generate, then train: every step's samples come from the weights it trains (HybridFlow's sync loop)."""

    def _take(self, step: int, version: int) -> tuple[Batch, dict[str, float]]:
        timings: dict[str, float] = {}
        batch, metrics = self._collect_step(version, timings)
        return batch, {**metrics, **timings}


def staleness_metrics(batch: Batch, version: int, max_staleness: int) -> dict[str, float]:
    """How many actor updates behind the trained weights (``version``) each sample's generating weights are:
    mean, max and a histogram over 0..``max_staleness``; with partial rollouts, per token too."""
    lag = version - batch["weight_version"]
    out = {"rollout/weight_version": float(version), "rollout/staleness/mean": lag.float().mean().item(),
           "rollout/staleness/max": lag.float().max().item()}
    for j in range(max_staleness + 1):
        out[f"rollout/staleness/frac_{j}"] = (lag == j).float().mean().item()
    if "token_weight_versions" in batch:  # partial rollouts: the version of each response token
        mask = batch["response_mask"].bool()
        versions = batch["token_weight_versions"]
        newest = versions.masked_fill(~mask, -1).max(-1).values
        oldest = versions.masked_fill(~mask, 2**62).min(-1).values
        out["rollout/partial/mixed_version_frac"] = (newest > oldest).float().mean().item()
        staleness = (version - versions).float()
        out["rollout/partial/token_staleness_mean"] = ((staleness * mask).sum() / mask.sum().clamp(min=1)).item()
    return out
