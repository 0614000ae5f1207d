"""The controller-side RL dataflow: one loop for PPO, GRPO, RLOO, REINFORCE++, ReMax, Safe-RLHF, DAPO and
on-policy distillation.

Runs on rank 0. Every heavy step is one call on a worker group (SPMD on its ranks); the light math in
between (KL in reward, advantages, Lagrangian) runs here on CPU tensors through the pure functions of
`torchrlhf.algorithms`. Where the samples come from — generated now, or ahead of time by rollout threads —
is the rollout source's business (`torchrlhf.rollouts`): the loop is the same for every schedule.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from torchrlhf import algorithms
from torchrlhf.data import Batch
from torchrlhf.rollouts import RolloutSource, staleness_metrics
from torchrlhf.runtime import new_process_group
from torchrlhf.runtime.profiling import StepProfiler
from torchrlhf.algorithms.masked import at_last_token
from torchrlhf.trainer.checkpointing import CheckpointManager, SnapshotManager, SnapshotPublish, checkpoint_step
from torchrlhf.trainer.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from torchrlhf.trainer.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    rollout_mismatch_metrics,
    validation_summary,
)
from torchrlhf.trainer.prompts import PromptLoader
from torchrlhf.utils.timer import timer



@dataclass
class Roles:
    """Controller handles of the training worker groups; absent roles are None. ``rollout`` is only asked
    for its peak FLOP/s at start-up: generation goes through the rollout source. ``teacher``: the frozen
    model of on-policy distillation (``algorithm.distill``)."""

    actor: Any
    ref: Any = None
    critic: Any = None
    rollout: Any = None
    teacher: Any = None


class RLTrainer:
    """Drives the roles through the RL dataflow, step by step.

    Args:
        roles: worker-group handles of the trained and reference models (see `Roles`).
        algorithm / rollout_cfg / trainer_cfg: the recipe's ``algorithm``, ``rollout`` and ``trainer`` sections.
        source: where each step's scored samples come from (`torchrlhf.rollouts.RolloutSource`).
        scorer: scores a generation Batch (`torchrlhf.rollouts.Scorer`; validation accuracy is its outcome).
        train_prompts / val_prompts: prompt loaders yielding Batches of prompts.
        logger: metric logger with ``log(metrics, step)`` and ``log_samples(rows, step)``.
        num_devices: ranks in the job, for per-device throughput.
        recompute_old_log_prob: run the actor's extra forward for old log-probs; `build_trainer` passes
            `torchrlhf.trainer.schema.needs_old_log_prob`. Off when one optimizer step consumes the whole
            rollout (one PPO epoch, one mini-batch) and neither KL in the reward nor distillation needs them:
            the update then uses its own log-probs, detached, which is exact (and, in asynchronous training,
            is decoupled PPO's proximal policy).
        max_staleness: how many versions samples may lag (0 when synchronous), for the staleness histogram.
        safe_rlhf: the samples carry ``cost_scores`` (a cost model): constrain them with a Lagrange multiplier.
        profiler: which steps' worker calls are recorded with torch.profiler (``trainer.profile``).
        fingerprint: what a memory snapshot must match to be resumed (`checkpointing.run_fingerprint`).
    """

    def __init__(
        self,
        *,
        algorithm: AlgorithmConfig,
        rollout_cfg: RolloutConfig,
        trainer_cfg: TrainerConfig,
        roles: Roles,
        source: RolloutSource,
        scorer: Any,
        train_prompts: PromptLoader,
        val_prompts: PromptLoader | None,
        logger: Any,
        num_devices: int,
        recompute_old_log_prob: bool = True,
        max_staleness: int = 0,
        safe_rlhf: bool = False,
        profiler: StepProfiler | None = None,
        fingerprint: str = "",
    ) -> None:
        self.algo = algorithm
        self.estimator = algorithms.ADV_ESTIMATORS[algorithm.adv_estimator]
        self.rollout_cfg = rollout_cfg
        self.trainer_cfg = trainer_cfg
        self.roles = roles
        self.source = source
        self.scorer = scorer
        self.train_prompts = train_prompts
        self.val_prompts = val_prompts
        self.logger = logger
        self.num_devices = num_devices
        self.recompute_old_log_prob = recompute_old_log_prob
        self.max_staleness = max_staleness
        self.temperature = rollout_cfg.sampling().logprob_temperature  # of the rollout log-probs and the recomputed ones
        self.global_step = 0
        self.weight_version = 0  # actor updates so far; every sample records the version that generated it
        self.kl_ctrl = algorithm.kl_ctrl.controller()
        self.lagrange = algorithm.lagrangian.multiplier() if safe_rlhf else None
        self.profiler = profiler or StepProfiler()
        ckpt = trainer_cfg.checkpoint
        self.checkpoints = CheckpointManager(trainer_cfg.output_dir, keep_last=ckpt.keep_last)
        self.snapshots = SnapshotManager(ckpt.snapshot_dir or SnapshotManager.default_root(trainer_cfg.output_dir),
                                         fingerprint) if ckpt.snapshot_freq > 0 else None
        self._publishing: SnapshotPublish | None = None  # the snapshot being written, published when whole

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        """Train for ``trainer.total_steps`` steps; returns the last step's metrics."""
        self._connect_snapshot_peers()
        self._maybe_resume()
        self._reserve_snapshots()
        self.peak_flops = self._peak_flops()
        self.source.start(self.weight_version)
        try:
            metrics = self._fit()
            self.wait_snapshot()
        finally:
            self.source.stop()
        self._drop_snapshots()
        return metrics

    def _fit(self) -> dict[str, float]:
        before: dict[str, float] = {}
        if self.val_prompts is not None and self.trainer_cfg.val_before_train and self.global_step == 0:
            before = self.validate()
            self.logger.log(before, step=0)
        metrics: dict[str, float] = {}
        while self.global_step < self.trainer_cfg.total_steps:
            self.global_step += 1
            with self.profiler.step(self.global_step):
                metrics = self.train_step()
            last = self.global_step == self.trainer_cfg.total_steps
            if self.val_prompts is not None and self.trainer_cfg.test_freq > 0 and (
                self.global_step % self.trainer_cfg.test_freq == 0 or last
            ):
                metrics.update(self.validate())
            snapshot_freq = self.trainer_cfg.checkpoint.snapshot_freq
            if self.snapshots is not None and self.global_step % snapshot_freq == 0:
                with timer("save_snapshot", metrics):
                    self.save_snapshot(metrics)
            save_freq = self.trainer_cfg.checkpoint.save_freq
            if save_freq > 0 and (self.global_step % save_freq == 0 or last):
                with timer("save_checkpoint", metrics):
                    self.save_checkpoint(metrics)
            self.logger.log(metrics, step=self.global_step)
        summary = validation_summary(before, metrics)
        if summary:
            self.logger.message(summary)
        return metrics

    def _peak_flops(self) -> dict[str, float]:
        """Each role's peak FLOP/s per device, the ``perf/mfu/*`` denominators: ``trainer.peak_flops``, or
        measured now on the role's ranks in its dtype (the mean over its ranks is logged)."""
        groups = {"actor": self.roles.actor, "ref": self.roles.ref, "teacher": self.roles.teacher,
                  "critic": self.roles.critic, "rollout": self.roles.rollout}
        peaks = {}
        for role, group in groups.items():
            if group is not None:
                per_rank = group.peak_flops(self.trainer_cfg.peak_flops)
                peaks[f"perf/peak_flops/{role}"] = sum(per_rank) / len(per_rank)
        how = "given (trainer.peak_flops)" if self.trainer_cfg.peak_flops else "measured (matmul probe)"
        self.logger.message(f"torchrlhf: peak FLOP/s per device, {how}: "
                            + ", ".join(f"{k.rsplit('/', 1)[1]} {v / 1e9:.1f} G" for k, v in peaks.items()))
        return peaks

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        batch, metrics = self.source.next_batch(self.global_step, self.weight_version)
        metrics.update(self.peak_flops)
        roles, algo, temperature = self.roles, self.algo, self.temperature

        if self.recompute_old_log_prob:
            with timer("old_log_prob", metrics):
                batch = batch.union(roles.actor.compute_log_prob(batch, temperature=temperature, entropy=True))
            metrics.update(rollout_mismatch_metrics(batch))
        if "entropys" in batch:
            metrics["actor/entropy"] = _masked_mean(batch.pop("entropys"), batch["response_mask"])
        if roles.ref is not None:
            with timer("ref", metrics):
                batch = batch.union(roles.ref.compute_ref_log_prob(batch, temperature=temperature))
        if roles.teacher is not None:
            with timer("teacher", metrics):
                batch = batch.union(roles.teacher.compute_teacher_log_prob(batch, temperature=temperature))
        if roles.critic is not None:
            with timer("values", metrics):
                batch = batch.union(roles.critic.compute_values(batch))
        metrics.update(_pop_perf(batch))  # the MFU of each pass so far (rollout, old log-probs, ref, teacher, values)

        with timer("adv", metrics):
            if algo.use_kl_in_reward:
                rewards, kl_metrics = algorithms.apply_kl_penalty(
                    batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                    batch["response_mask"], self.kl_ctrl, kind=algo.kl_penalty,
                )
                metrics.update(kl_metrics)
                self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=len(batch))
            else:
                rewards = batch["token_level_scores"]
            batch["token_level_rewards"] = rewards
            advantages, returns = self._advantages(batch, rewards)
            if self.lagrange is not None:
                advantages = self._apply_safe_rlhf(batch, advantages, metrics)
            if algo.distill is not None:
                advantages, metrics["distill/reverse_kl"] = algorithms.distill_advantages(
                    advantages, batch["old_log_probs"], batch["teacher_log_prob"], batch["response_mask"],
                    coef=algo.distill.coef, task_coef=algo.distill.task_coef)
            batch["advantages"], batch["returns"] = advantages, returns

        self.wait_snapshot()  # the last step's snapshot is published before this step changes the state
        if roles.critic is not None:
            with timer("update_critic", metrics):
                metrics.update(roles.critic.update(batch))
        metrics.update(staleness_metrics(batch, self.weight_version, self.max_staleness))
        if self.global_step > self.trainer_cfg.critic_warmup:
            with timer("update_actor", metrics):
                metrics.update(roles.actor.update(batch, temperature=temperature))
            self.weight_version += 1
        metrics.update(self.source.publish(self.weight_version))

        step_seconds = time.perf_counter() - start
        metrics["timing_s/step"] = step_seconds
        metrics["training/global_step"] = float(self.global_step)
        metrics.update(compute_data_metrics(batch, self.rollout_cfg.max_tokens))
        metrics.update(compute_throughput_metrics(batch, step_seconds, self.num_devices))
        if algo.use_kl_in_reward:
            metrics["actor/kl_coef"] = self.kl_ctrl.value
        return metrics

    def close(self) -> None:
        """Flush the loggers and stop the reward worker processes."""
        self.logger.close()
        self.scorer.close()

    # ------------------------------------------------------------------ advantages
    def _advantages(self, batch: Batch, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The configured estimator over token-level ``rewards``: it gets the batch columns its traits name
        (`Estimator.inputs`) and the algorithm's hyper-parameters."""
        algo = self.algo
        inputs = {keyword: batch[column] for keyword, column in self.estimator.inputs.items()}
        return algorithms.compute_advantage(algo.adv_estimator, rewards, batch["response_mask"], **inputs,
                                            gamma=algo.gamma, lam=algo.lam, norm_adv_by_std=algo.norm_adv_by_std)

    def _apply_safe_rlhf(self, batch: Batch, reward_adv: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """Safe-RLHF: advantage of the Lagrangian, then the multiplier's dual ascent step."""
        costs = batch["cost_scores"]
        token_costs = at_last_token(costs, batch["response_mask"])
        # The same estimator over the costs: one without values or a greedy baseline (checked by the config
        # schema), so the inputs its traits name (the group uids) hold for the costs as for the rewards.
        cost_adv, _ = self._advantages(batch, token_costs)
        lam = self.lagrange.value
        combined = algorithms.combine_safe_advantages(reward_adv, cost_adv, lam)
        self.lagrange.update(costs.float().mean().item())
        metrics["safe_rlhf/lambda"] = float(lam)
        metrics["safe_rlhf/cost_mean"] = costs.float().mean().item()
        return combined

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Greedy (or configured) generation on the validation set; accuracy per data source."""
        assert self.val_prompts is not None
        sampling = self.rollout_cfg.val_sampling()
        per_source: dict[str, list[float]] = {}
        samples: list[dict[str, Any]] = []
        for prompts in self.val_prompts.epoch():
            gen = self.source.validation_batch(prompts, sampling)
            seq_scores = self.scorer.outcome(gen)[0].tolist()
            for data_source, score in zip(gen["data_source"], seq_scores):
                per_source.setdefault(data_source, []).append(score)
            if len(samples) < self.trainer_cfg.log_val_generations:
                texts = self.train_prompts.decode(gen["responses"], gen["response_mask"])
                rows = [{"prompt": str(p), "response": t, "score": s, "ground_truth": g, "data_source": d}
                        for p, t, s, g, d in zip(gen["raw_prompt"], texts, seq_scores, gen["ground_truth"],
                                                 gen["data_source"])]
                if "num_turns" in gen:  # agents: the whole trajectory, with what the tools and environment returned
                    width = gen["responses"].shape[1]
                    whole = self.train_prompts.decode(gen["responses"], gen["attention_mask"][:, -width:],
                                                      skip_special_tokens=False)
                    for row, text in zip(rows, whole):
                        row["trajectory"] = text
                samples.extend(rows)
        self.logger.log_samples(samples[: self.trainer_cfg.log_val_generations], step=self.global_step)
        return {f"val/{src}/acc": sum(v) / len(v) for src, v in per_source.items()}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, metrics: dict[str, float] | None = None) -> str:
        """``metrics``: the step's, kept so that a resume re-logs them if the job died before logging them."""
        def save_roles(path: str) -> None:
            self.roles.actor.save_checkpoint(f"{path}/actor")
            if self.roles.critic is not None:
                self.roles.critic.save_checkpoint(f"{path}/critic")

        with self.source.paused(drain=True):
            return self.checkpoints.save(self.global_step, save_roles, self._checkpoint_state(metrics))

    def _checkpoint_state(self, metrics: dict[str, float] | None) -> dict[str, Any]:
        state = self.controller_state()
        if metrics is not None:
            state["step_metrics"] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        return state

    def _trainable(self) -> list[Any]:
        return [g for g in (self.roles.actor, self.roles.critic) if g is not None]

    def save_snapshot(self, metrics: dict[str, float] | None = None) -> None:
        """Every trainable rank starts writing the slot not holding the published snapshot; a controller thread
        publishes it once every rank has written it, while the next step's rollout runs. A kill at any point
        leaves the last published snapshot whole. The next update waits for the publish (`wait_snapshot`)."""
        assert self.snapshots is not None
        self.wait_snapshot()
        slot = self.snapshots.next_slot()
        with self.source.paused(drain=True):
            for group in self._trainable():
                group.save_snapshot(self.snapshots.root, slot, self.global_step)
        written = [group.finish_snapshot.async_() for group in self._trainable()]
        self._publishing = SnapshotPublish(self.snapshots, self.global_step, slot, self._checkpoint_state(metrics),
                                           written)

    def wait_snapshot(self) -> None:
        """Block until the snapshot being written is published (raises what failed in its writing)."""
        if self._publishing is not None:
            publishing, self._publishing = self._publishing, None
            publishing.wait()

    def _connect_snapshot_peers(self) -> None:
        """With ``snapshot_peer``, pair each trainable rank with a rank on another node that keeps its copy."""
        if self.snapshots is None or not self.trainer_cfg.checkpoint.snapshot_peer:
            return
        for group in self._trainable():
            key = f"{group.name}_snapshot_peers"
            new_process_group(key, group.ranks)
            keepers = group.connect_snapshot_peers(key)
            self.logger.message(f"torchrlhf: each memory snapshot of {group.name} is also kept on another node "
                                f"(rank -> keeper: {dict(zip(group.ranks, keepers))})")

    def _reserve_snapshots(self) -> None:
        if self.snapshots is None:
            return
        per_slot = sum(sum(group.reserve_snapshot(self.snapshots.root)) for group in self._trainable())
        self.logger.message(f"torchrlhf: a memory snapshot every {self.trainer_cfg.checkpoint.snapshot_freq} "
                            f"step(s) in {self.snapshots.root} (2 slots x {per_slot / 2**30:.2f} GiB reserved)")

    def _drop_snapshots(self) -> None:
        """A finished run gives its shared memory back (its disk checkpoints stay)."""
        if self.snapshots is None:
            return
        for group in self._trainable():
            group.drop_snapshot(self.snapshots.root)
        self.snapshots.clear()

    def _resumable_snapshot(self, disk_path: str | None) -> dict[str, Any] | None:
        """The published memory snapshot when this run can resume from it and no disk checkpoint is newer:
        the same fingerprint, and every trainable rank still holds the slot (a replaced node does not)."""
        if self.snapshots is None or self.trainer_cfg.checkpoint.resume != "auto":
            return None
        latest = self.snapshots.latest()
        if latest is None:
            return None
        why = self.snapshots.refusal(latest)
        if why is None and disk_path is not None and checkpoint_step(disk_path) > latest["step"]:
            return None
        sources: dict[str, dict[int, int]] = {}
        if why is None:
            missing = {}
            for group in self._trainable():
                holdings = group.snapshot_holdings(self.snapshots.root, latest["slot"])
                sources[group.name], lost = _copy_sources(group.ranks, holdings, latest["step"])
                if lost:
                    missing[group.name] = lost
            if missing:
                why = (f"the memory snapshot of step {latest['step']} in {self.snapshots.root} is incomplete on "
                       f"the ranks {missing} (a node replaced?), with no copy on another node; not resuming from it")
        if why is not None:
            fallback = f"resuming from {disk_path}" if disk_path else "no disk checkpoint to resume from"
            self.logger.message(f"torchrlhf: {why}; {fallback}")
            return None
        return {**latest, "sources": sources}

    def controller_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "weight_version": self.weight_version,
            "sampler": self.train_prompts.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "rollouts": {"schedule": type(self.source).__name__, **self.source.state_dict()},
        }
        if self.lagrange is not None:
            state["lagrange"] = self.lagrange.state_dict()
        return state

    def _maybe_resume(self) -> None:
        started = time.perf_counter()
        path = self.checkpoints.resolve(self.trainer_cfg.checkpoint.resume)
        snapshot = self._resumable_snapshot(path)
        if snapshot is not None:
            assert self.snapshots is not None
            state = self.snapshots.load_controller_state(snapshot["slot"])
            copied = []
            for group in self._trainable():
                sources = snapshot["sources"][group.name]
                group.load_snapshot(self.snapshots.root, snapshot["slot"], snapshot["step"], sources)
                copied += [f"{group.name} rank {lost} from rank {keeper}" for lost, keeper in sources.items()]
            path = f"the memory snapshot of step {snapshot['step']} ({self.snapshots.root})"
            if copied:
                path += f" (parts lost with their node, copied back from another node: {', '.join(copied)})"
        elif path is None:
            return
        else:
            state = self.checkpoints.load_controller_state(path)
            self.roles.actor.load_checkpoint(f"{path}/actor")
            if self.roles.critic is not None:
                self.roles.critic.load_checkpoint(f"{path}/critic")
        self.global_step = state["global_step"]
        self.weight_version = state["weight_version"]
        self.train_prompts.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if self.lagrange is not None:
            self.lagrange.load_state_dict(state["lagrange"])
        saved = state["rollouts"]
        if saved["schedule"] != type(self.source).__name__:
            raise ValueError(f"checkpoint {path} was written with {saved['schedule']} rollouts (trainer.mode / "
                             f"async_training.schedule); this run has {type(self.source).__name__}")
        self.source.load_state_dict(saved)
        # A job that died after this checkpoint logged later steps: the resumed run logs them again, once.
        self.logger.rewind(self.global_step, state.get("step_metrics"))
        total = self.trainer_cfg.total_steps
        if self.global_step >= total:
            self.logger.message(f"torchrlhf: resumed from {path}: total_steps={total} already reached; nothing to "
                                "train; trainer.checkpoint.resume=disable or a new trainer.output_dir starts afresh")
        else:
            self.logger.message(f"torchrlhf: resumed from {path} at step {self.global_step} of {total} (state "
                                f"loaded in {time.perf_counter() - started:.1f} s)")


def _pop_perf(batch: Batch) -> dict[str, float]:
    """The ``perf/*`` figures the workers' passes left in ``batch.meta``, taken out of it."""
    return {k: float(batch.meta.pop(k)) for k in [k for k in batch.meta if k.startswith("perf/")]}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


__all__ = ["RLTrainer", "Roles"]


def _copy_sources(ranks: list[int], holdings: list[dict], step: int) -> tuple[dict[int, int], list[int]]:
    """({rank whose own part of ``step`` is gone: the rank keeping a copy of it}, [ranks with neither])."""
    sources, lost = {}, []
    for rank, held in zip(ranks, holdings):
        if held["own"] == step:
            continue
        keeper = next((r for r, h in zip(ranks, holdings) if h["copies"].get(rank) == step), None)
        if keeper is None:
            lost.append(rank)
        else:
            sources[rank] = keeper
    return sources, lost
