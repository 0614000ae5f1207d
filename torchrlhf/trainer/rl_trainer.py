"""The controller-side RL dataflow: one loop for PPO, GRPO, RLOO, REINFORCE++, ReMax, Safe-RLHF and DAPO.

Runs on rank 0. Every heavy step is one call on a worker group (SPMD on its
ranks); the light math in between (KL in reward, advantages, Lagrangian) runs
here on CPU tensors through the pure functions of `torchrlhf.algorithms`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from torchrlhf import algorithms
from torchrlhf.data import Batch
from torchrlhf.runtime.group import WorkerError
from torchrlhf.trainer.async_rollout import AsyncRollouts, DeterministicRollouts, StreamRollouts
from torchrlhf.trainer.checkpointing import CheckpointManager
from torchrlhf.trainer.config import AlgorithmConfig, AsyncConfig, RolloutConfig, TrainerConfig
from torchrlhf.trainer.metrics import (
    compute_data_metrics,
    compute_throughput_metrics,
    rollout_mismatch_metrics,
    validation_summary,
)
from torchrlhf.trainer.prompts import PromptLoader
from torchrlhf.utils.timer import timer
from torchrlhf.workers.rollout import RELAY_VERSION

log = logging.getLogger(__name__)

@dataclass
class Roles:
    """Controller handles of the worker groups; absent roles are None."""

    actor: Any
    rollout: Any = None
    ref: Any = None
    critic: Any = None
    reward_model: Any = None
    cost_model: Any = None
    weight_sync: Any = None  # split placement: pushes new actor weights to the rollout ranks (`WeightSync`)


class RLTrainer:
    """Drives the roles through the RL dataflow, step by step.

    Args:
        roles: worker-group handles (see `Roles`).
        reward_fn: scores a generation Batch; returns (token_level_scores [B, R], metrics).
        train_prompts / val_prompts: prompt loaders yielding Batches of prompts.
        logger: metric logger with ``log(metrics, step)`` and ``log_samples(rows, step)``.
        num_devices: ranks in the job, for per-device throughput.
        recompute_old_log_prob: run the actor's extra forward for old log-probs. `build_trainer` turns it
            off when one optimizer step consumes the whole rollout (one PPO epoch, one mini-batch) and no
            KL-in-reward needs them: the update then uses its own log-probs, detached, which is exact
            (and, in asynchronous training, is decoupled PPO's proximal policy).
        async_training: how rollouts run ahead of training when ``trainer.mode`` is ``async``.
    """

    def __init__(
        self,
        *,
        algorithm: AlgorithmConfig,
        rollout: RolloutConfig,
        trainer: TrainerConfig,
        roles: Roles,
        reward_fn: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]],
        train_prompts: PromptLoader,
        val_prompts: PromptLoader | None,
        logger: Any,
        num_devices: int,
        recompute_old_log_prob: bool = True,
        async_training: AsyncConfig | None = None,
    ) -> None:
        self.algo = algorithm
        self.rollout = rollout
        self.cfg = trainer
        self.roles = roles
        self.reward_fn = reward_fn
        self.train_prompts = train_prompts
        self.val_prompts = val_prompts
        self.logger = logger
        self.num_devices = num_devices
        self.recompute_old_log_prob = recompute_old_log_prob or algorithm.use_kl_in_reward
        self.global_step = 0
        self.weight_version = 0  # actor updates so far; every sample records the version that generated it
        torch.manual_seed(trainer.seed)  # draws the per-prompt sampling seeds; saved with checkpoints
        self.kl_ctrl = _make_kl_controller(algorithm)
        self.lagrange = (
            algorithms.LagrangeMultiplier(
                init=algorithm.lagrangian_init,
                lr=algorithm.lagrangian_lr,
                threshold=algorithm.cost_threshold,
                max_value=algorithm.lagrangian_max,
            )
            if roles.cost_model is not None
            else None
        )
        self.checkpoints = CheckpointManager(trainer.output_dir, keep_last=trainer.keep_last_checkpoints)
        self.async_cfg = async_training or AsyncConfig()
        self.async_rollouts: AsyncRollouts | None = None  # built by `fit` in async mode
        self._busy_mark: dict[int, tuple[float, float]] = {}  # rollout rank -> (its clock, its busy seconds)

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, float]:
        """Train for ``trainer.total_steps`` steps; returns the last step's metrics."""
        if self.cfg.mode == "async":
            self.async_rollouts = self._build_async_rollouts()
        self._maybe_resume()
        if self.async_rollouts is not None:
            self.async_rollouts.publish(self.weight_version)
            self.async_rollouts.start()
        try:
            return self._fit()
        finally:
            if self.async_rollouts is not None:
                self.async_rollouts.stop()

    def _fit(self) -> dict[str, float]:
        before: dict[str, float] = {}
        if self.val_prompts is not None and self.cfg.val_before_train and self.global_step == 0:
            before = self.validate()
            self.logger.log(before, step=0)
        metrics: dict[str, float] = {}
        while self.global_step < self.cfg.total_steps:
            self.global_step += 1
            metrics = self.train_step()
            last = self.global_step == self.cfg.total_steps
            if self.val_prompts is not None and self.cfg.test_freq > 0 and (
                self.global_step % self.cfg.test_freq == 0 or last
            ):
                metrics.update(self.validate())
            if self.cfg.save_freq > 0 and (self.global_step % self.cfg.save_freq == 0 or last):
                with timer("save_checkpoint", metrics):
                    self.save_checkpoint(metrics)
            self.logger.log(metrics, step=self.global_step)
        summary = validation_summary(before, metrics)
        if summary:
            self.logger.message(summary)
        return metrics

    def train_step(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        start = time.perf_counter()
        batch = self._collect_rollouts(metrics)
        roles, algo = self.roles, self.algo

        if self.recompute_old_log_prob:
            with timer("old_log_prob", metrics):
                batch.meta["calculate_entropy"] = True
                batch = batch.union(roles.actor.compute_log_prob(batch))
            metrics.update(rollout_mismatch_metrics(batch))
        if "entropys" in batch:
            metrics["actor/entropy"] = _masked_mean(batch.pop("entropys"), batch["response_mask"])
        if roles.ref is not None:
            with timer("ref", metrics):
                batch = batch.union(roles.ref.compute_ref_log_prob(batch))
        if roles.critic is not None:
            with timer("values", metrics):
                batch = batch.union(roles.critic.compute_values(batch))

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
            batch["advantages"], batch["returns"] = advantages, returns

        if roles.critic is not None:
            with timer("update_critic", metrics):
                metrics.update(roles.critic.update(batch))
        metrics.update(_staleness_metrics(batch, self.weight_version))
        if self.global_step > self.cfg.critic_warmup:
            with timer("update_actor", metrics):
                metrics.update(roles.actor.update(batch))
            self.weight_version += 1
            self._sync_weights(metrics)
        elif self.async_rollouts is not None:  # the step is done, with the same weights
            self.async_rollouts.publish(self.weight_version)

        step_seconds = time.perf_counter() - start
        metrics.update(self._rollout_busy_metrics())
        metrics["timing_s/step"] = step_seconds
        metrics["training/global_step"] = float(self.global_step)
        metrics.update(compute_data_metrics(batch, self.rollout.max_tokens))
        metrics.update(compute_throughput_metrics(batch, step_seconds, self.num_devices))
        if algo.use_kl_in_reward:
            metrics["actor/kl_coef"] = self.kl_ctrl.value
        return metrics

    def _sync_weights(self, metrics: dict[str, float]) -> None:
        """Split placement: the rollout ranks get the new version now (colocated, they read it at generate).

        Asynchronous training sends it into the rollout ranks' relays while they generate, then lets the
        rollout thread use it.
        """
        if self.roles.weight_sync is not None:
            relay = self.async_rollouts is not None
            with timer("weight_sync", metrics):
                metrics.update(self.roles.weight_sync(self.weight_version, to_relay=relay))
            if relay:
                self.async_rollouts.publish(self.weight_version)

    def _rollout_busy_metrics(self) -> dict[str, float]:
        """Split placement: the share of wall time since the last step that rollout ranks spent generating."""
        if self.roles.weight_sync is None:
            return {}
        rollout = self.roles.rollout
        ranks = rollout.live_ranks
        try:
            answers = rollout.busy_seconds()
        except WorkerError:
            if not self._dropped_dead_rollouts(ranks):
                raise
            return {}  # a rollout rank just died
        busy = {r: (clock, float(b.get("generate", 0.0))) for r, (clock, b) in zip(ranks, answers)}
        mark, self._busy_mark = self._busy_mark, busy
        fractions = [(b - mark[r][1]) / max(clock - mark[r][0], 1e-9) for r, (clock, b) in busy.items() if r in mark]
        if not fractions:
            return {}
        return {"rollout/busy_fraction": sum(fractions) / len(fractions), "rollout/busy_fraction_min": min(fractions)}

    @contextlib.contextmanager
    def _rollouts_paused(self, drain: bool = False) -> Iterator[None]:
        """Asynchronous training: no rollout call runs inside (validation uses the engines; checkpoints
        save the rollout buffer, after ``drain``-ing what the published version allows)."""
        if self.async_rollouts is None:
            yield
        else:
            with self.async_rollouts.paused(drain=drain):
                yield

    def close(self) -> None:
        """Flush the loggers and stop the reward worker processes."""
        self.logger.close()
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ rollout
    def _collect_rollouts(self, metrics: dict[str, float]) -> Batch:
        """Generate and score; with DAPO's dynamic sampling, keep drawing until enough informative groups."""
        if self.async_rollouts is not None:
            return self._take_async_rollouts(metrics)
        want_groups = self.train_prompts.batch_size
        kept: list[Batch] = []
        num_groups = num_gen_batches = dropped = 0
        while num_groups < want_groups:
            num_gen_batches += 1
            if num_gen_batches > max(1, self.algo.max_num_gen_batches):
                raise RuntimeError(
                    f"dynamic sampling: only {num_groups} of {want_groups} prompt groups had non-constant rewards "
                    f"after {num_gen_batches - 1} generation batches (algorithm.max_num_gen_batches); "
                    "the data may be too hard or too easy for the model"
                )
            with timer("gen", metrics, accumulate=True):
                gen = self._generate(self.train_prompts.next_batch(), self.rollout.sampling_params())
            with timer("reward", metrics, accumulate=True):
                gen = self._score(gen, metrics)
            if self.rollout.n > 1 and self.algo.adv_estimator == "remax":
                raise ValueError("remax uses one sample per prompt plus a greedy baseline: set rollout.n=1")
            if self.algo.adv_estimator == "remax":
                with timer("gen_baseline", metrics, accumulate=True):
                    gen["reward_baselines"] = self._greedy_baseline(gen)
            if not self.algo.filter_groups:
                return gen
            keep, n_dropped = algorithms.filter_groups(gen["uid"], gen["token_level_scores"].sum(-1))
            dropped += n_dropped
            gen = gen[keep]
            kept.append(gen)
            num_groups += len(set(gen["uid"]))
        metrics["train/num_gen_batches"] = float(num_gen_batches)
        metrics["train/dropped_groups"] = float(dropped)
        batch = Batch.concat(kept)
        return batch[: want_groups * self.rollout.n]

    def _build_async_rollouts(self) -> AsyncRollouts:
        a = self.async_cfg
        common = dict(next_prompts=self.train_prompts.next_batch, score=self._score_rules,
                      sampling=self.rollout.sampling_params(), batch_size=self.train_prompts.batch_size,
                      n=self.rollout.n, max_staleness=a.max_staleness, pad_id=self.train_prompts.pad_id,
                      seed=self.cfg.seed, lose_replicas=self._may_lose_rollouts())
        if a.schedule == "deterministic":
            return DeterministicRollouts(self.roles.rollout, warmup=self.cfg.critic_warmup, **common)
        return StreamRollouts(self.roles.rollout, prompts_per_call=a.prompts_per_call,
                              stale_policy=a.stale_policy, filter_groups=self.algo.filter_groups,
                              baseline=self._baseline_scores if self.algo.adv_estimator == "remax" else None,
                              max_filtered=max(1, self.algo.max_num_gen_batches) * self.train_prompts.batch_size,
                              partial_rollout=a.partial_rollout, **common)

    def _take_async_rollouts(self, metrics: dict[str, float]) -> Batch:
        """The next batch the rollout thread has ready (generated and rule-scored while the actor trained)."""
        with timer("rollout_wait", metrics):
            key = self.global_step - 1 if self.async_cfg.schedule == "deterministic" else self.weight_version
            batch, async_metrics = self.async_rollouts.take(key)
        metrics.update(async_metrics)
        with timer("reward", metrics):
            batch = self._score_models(batch)
        lag = self.weight_version - batch["weight_version"]
        for j in range(self.async_cfg.max_staleness + 1):
            metrics[f"rollout/staleness/frac_{j}"] = (lag == j).float().mean().item()
        return batch

    def _generate(self, prompts: Batch, sampling: dict[str, Any]) -> Batch:
        # Fresh per-prompt seeds from the controller's RNG: reproducible, resumable, different every step.
        prompts["seed"] = torch.randint(0, 2**31 - 1, (len(prompts),))
        prompts.meta["sampling"] = sampling
        prompts.meta["weight_version"] = self.weight_version
        if self.async_rollouts is not None:  # validation: the newest version the relays hold
            prompts.meta[RELAY_VERSION] = self.async_rollouts.published
        while True:
            called = self.roles.rollout.live_ranks
            try:
                gen = self.roles.rollout.generate(prompts)
                break
            except WorkerError:  # a rollout rank died: again on the live replicas, where allowed
                if not self._dropped_dead_rollouts(called):
                    raise
        gen.meta["temperature"] = sampling["temperature"] or 1.0
        return gen

    def _may_lose_rollouts(self) -> bool:
        """Whether a dead rollout replica is dropped instead of ending the run (`build.may_lose_rollout_replicas`)."""
        return self.roles.weight_sync is not None and self.roles.weight_sync.lose_rollout_replicas

    def _dropped_dead_rollouts(self, called: list[int]) -> bool:
        """A rollout call to ``called`` failed: True if one of its replicas lost a rank and was
        dropped (`WorkerGroup.drop_dead`), so it may go again to the live replicas. The error need not come
        from the dead rank: a TP peer's collective can fail first."""
        return self._may_lose_rollouts() and self.roles.rollout.drop_dead(called)

    def _greedy_baseline(self, gen: Batch) -> torch.Tensor:
        """ReMax: reward of the greedy response to the same prompt (one per sample)."""
        prompts = Batch(
            {"input_ids": gen["prompts"], "attention_mask": gen["attention_mask"][:, : gen["prompts"].shape[1]]},
            {k: gen[k] for k in ("uid", "raw_prompt", "ground_truth", "data_source") if k in gen},
        )
        greedy = self._generate(prompts, {**self.rollout.sampling_params(), "n": 1, "temperature": 0.0})
        return self._baseline_scores(greedy)

    def _baseline_scores(self, greedy: Batch) -> torch.Tensor:
        """ReMax: the sequence reward of each greedy response (rule reward, plus the reward model's score)."""
        scores = self.reward_fn(greedy)[0].sum(-1)
        if self.roles.reward_model is not None:
            scores = scores + self.roles.reward_model.compute_scores(greedy)["rm_scores"]
        return scores

    def _score(self, gen: Batch, metrics: dict[str, float]) -> Batch:
        gen, reward_metrics = self._score_rules(gen)
        metrics.update(reward_metrics)
        return self._score_models(gen)

    def _score_models(self, gen: Batch) -> Batch:
        """Add the reward model's score and the cost model's costs (worker calls: on the trainer's thread)."""
        if self.roles.reward_model is not None:
            rm = self.roles.reward_model.compute_scores(gen)["rm_scores"]
            gen["token_level_scores"] = gen["token_level_scores"] + _at_last_token(rm, gen["response_mask"])
        if self.roles.cost_model is not None:
            gen["cost_scores"] = self.roles.cost_model.compute_scores(gen)["cost_scores"]
        return gen

    def _score_rules(self, gen: Batch) -> tuple[Batch, dict[str, float]]:
        """``token_level_scores`` from the reward function and the overlong penalty (no worker calls, so the
        asynchronous rollout thread runs it as soon as a trajectory returns)."""
        scores, metrics = self.reward_fn(gen)
        metrics = dict(metrics)
        if self.algo.overlong_buffer_len > 0:
            penalty = algorithms.overlong_penalty(
                gen["response_mask"].sum(-1),
                max_response_length=self.rollout.max_tokens,
                overlong_buffer_len=self.algo.overlong_buffer_len,
                penalty_factor=self.algo.overlong_penalty_factor,
            )
            metrics["reward/overlong_penalty_mean"] = penalty.float().mean().item()
            scores = scores + _at_last_token(penalty, gen["response_mask"])
        gen["token_level_scores"] = scores
        return gen, metrics

    # ------------------------------------------------------------------ advantages
    def _advantages(self, batch: Batch, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        algo = self.algo
        return algorithms.compute_advantage(
            algo.adv_estimator,
            rewards,
            batch["response_mask"],
            values=batch.get("values"),
            index=batch["uid"],
            reward_baselines=batch.get("reward_baselines"),
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std,
        )

    def _apply_safe_rlhf(self, batch: Batch, reward_adv: torch.Tensor, metrics: dict[str, float]) -> torch.Tensor:
        """Safe-RLHF: advantage of the Lagrangian, then the multiplier's dual ascent step."""
        costs = batch["cost_scores"]
        token_costs = _at_last_token(costs, batch["response_mask"])
        cost_adv, _ = algorithms.compute_advantage(
            self.algo.adv_estimator,  # critic-free estimators only (checked by the config schema)
            token_costs,
            batch["response_mask"],
            index=batch["uid"],
            gamma=self.algo.gamma,
            norm_adv_by_std=self.algo.norm_adv_by_std,
        )
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
        sampling = self.rollout.val_sampling_params()
        per_source: dict[str, list[float]] = {}
        samples: list[dict[str, Any]] = []
        for prompts in self.val_prompts.epoch():
            with self._rollouts_paused():
                gen = self._generate(prompts, sampling)
            scores, _ = self.reward_fn(gen)
            seq_scores = scores.sum(-1).tolist()
            for source, score in zip(gen["data_source"], seq_scores):
                per_source.setdefault(source, []).append(score)
            if len(samples) < self.cfg.log_val_generations:
                texts = self.train_prompts.decode(gen["responses"], gen["response_mask"])
                for prompt, text, score in zip(gen["raw_prompt"], texts, seq_scores):
                    samples.append({"prompt": str(prompt), "response": text, "score": score})
        self.logger.log_samples(samples[: self.cfg.log_val_generations], step=self.global_step)
        return {f"val/{src}/acc": sum(v) / len(v) for src, v in per_source.items()}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, metrics: dict[str, float] | None = None) -> str:
        """``metrics``: the step's, kept so that a resume re-logs them if the job died before logging them."""
        def save_roles(path: str) -> None:
            self.roles.actor.save_checkpoint(f"{path}/actor")
            if self.roles.critic is not None:
                self.roles.critic.save_checkpoint(f"{path}/critic")

        with self._rollouts_paused(drain=True):
            state = self.controller_state()
            if metrics is not None:
                state["step_metrics"] = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
            return self.checkpoints.save(self.global_step, save_roles, state)

    def controller_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "weight_version": self.weight_version,
            "sampler": self.train_prompts.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "rng": torch.get_rng_state(),
        }
        if self.lagrange is not None:
            state["lagrange"] = self.lagrange.state_dict()
        if self.async_rollouts is not None:
            state["async_rollouts"] = {"schedule": self.async_cfg.schedule, **self.async_rollouts.state_dict()}
        return state

    def _maybe_resume(self) -> None:
        path = self.checkpoints.resolve(self.cfg.resume)
        if path is None:
            return
        state = self.checkpoints.load_controller_state(path)
        self.roles.actor.load_checkpoint(f"{path}/actor")
        if self.roles.critic is not None:
            self.roles.critic.load_checkpoint(f"{path}/critic")
        self.global_step = state["global_step"]
        self.weight_version = state["weight_version"]
        self._sync_weights({})
        self.train_prompts.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        torch.set_rng_state(state["rng"])
        if self.lagrange is not None:
            self.lagrange.load_state_dict(state["lagrange"])
        if self.async_rollouts is not None and "async_rollouts" in state:
            saved = state["async_rollouts"]
            if saved["schedule"] != self.async_cfg.schedule:
                raise ValueError(f"checkpoint {path} was written with async_training.schedule={saved['schedule']}; "
                                 f"this run has {self.async_cfg.schedule}")
            self.async_rollouts.load_state_dict(saved)
        # A job that died after this checkpoint logged later steps: the resumed run logs them again, once.
        self.logger.rewind(self.global_step, state.get("step_metrics"))
        total = self.cfg.total_steps
        if self.global_step >= total:
            self.logger.message(f"torchrlhf: resumed from {path}: total_steps={total} already reached; nothing to "
                                "train; trainer.resume=disable or a new trainer.output_dir starts afresh")
        else:
            self.logger.message(f"torchrlhf: resumed from {path} at step {self.global_step} of {total}")


def _make_kl_controller(algo: AlgorithmConfig):
    if algo.kl_ctrl_type == "adaptive":
        return algorithms.AdaptiveKLController(algo.kl_coef, algo.kl_target, algo.kl_horizon)
    return algorithms.FixedKLController(algo.kl_coef)


def _at_last_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place a per-sequence value at the last valid response token of a [B, R] tensor."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    last = (response_mask.sum(-1) - 1).clamp(min=0).long()
    out[torch.arange(len(out)), last] = values.float()
    return out


def _staleness_metrics(batch: Batch, version: int) -> dict[str, float]:
    """How many actor updates behind the trained weights each sample's generating weights are."""
    lag = (version - batch["weight_version"]).float()
    out = {"rollout/weight_version": float(version), "rollout/staleness/mean": lag.mean().item(),
           "rollout/staleness/max": lag.max().item()}
    if "token_weight_versions" in batch:  # partial rollouts: the version of each response token
        mask = batch["response_mask"].bool()
        versions = batch["token_weight_versions"]
        newest = versions.masked_fill(~mask, -1).max(-1).values
        oldest = versions.masked_fill(~mask, 2**62).min(-1).values
        out["rollout/partial/mixed_version_frac"] = (newest > oldest).float().mean().item()
        out["rollout/partial/token_staleness_mean"] = _masked_mean((version - versions).float(), mask)
    return out


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return ((x * mask).sum() / mask.sum().clamp(min=1)).item()


__all__ = ["RLTrainer", "Roles"]
