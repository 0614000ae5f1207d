"""One rollout unit, the same under every schedule: generate, the ReMax greedy pass, scoring, the group filter.

A schedule (`SyncRollouts`, `StreamRollouts`, `DeterministicRollouts`) decides *when* and *on which
replicas* a unit runs and with which weight version; everything a unit does is written here once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from torchrlhf import algorithms
from torchrlhf.algorithms import OverlongBuffer
from torchrlhf.algorithms.masked import at_last_token
from torchrlhf.data import Batch
from torchrlhf.generation.sampling import SamplingParams
from torchrlhf.utils.timer import timer

# (prompts, sampling) -> generation: where a unit generates (every replica, or one)
Generate = Callable[[Batch, SamplingParams], Batch]


def judge_metrics(out: Batch, seconds: float) -> dict[str, float]:
    """``judge/*`` of one judge call: failure counts, the mean (unweighted) score with failures at their
    ``on_failure_score``, and the call's time."""
    return {
        "judge/parse_failures": float(out["judge_parse_failed"].sum()),
        "judge/timeouts": float(out["judge_timed_out"].sum()),
        "judge/too_long": float(out["judge_too_long"].sum()),
        "judge/score_mean": out["judge_scores"].float().mean().item(),
        "judge/time_s": seconds,
    }


class Scorer:
    """``token_level_scores`` of generations, the one place rewards are composed:

        rule_weight * outcome + overlong penalty + reward model + judge_weight * judge

    The outcome (the reward function's score; for agent trajectories composed with the environment's reward as
    ``rollout.agent.reward`` says) and DAPO's overlong penalty run anywhere; the reward model's score, the
    LLM judge's score and the cost model's costs are worker calls. Validation reads the unweighted outcome.

    Model calls are serialised (several rollout threads may score at once, and a group runs one call at a
    time).
    """

    def __init__(self, reward_fn: Callable[[Batch], tuple[torch.Tensor, dict[str, float]]], *,
                 reward_model: Any = None, cost_model: Any = None, judge: Any = None, rule_weight: float = 1.0,
                 judge_weight: float = 1.0, max_tokens: int, overlong_buffer: OverlongBuffer | None = None,
                 agent: Any = None) -> None:
        self.reward_fn, self.reward_model, self.cost_model = reward_fn, reward_model, cost_model
        self.judge, self.rule_weight, self.judge_weight = judge, float(rule_weight), float(judge_weight)
        self.max_tokens = max_tokens
        self.overlong_buffer = overlong_buffer or OverlongBuffer()  # ``algorithm.overlong_buffer``: off by default
        self.agent = agent  # the rollout.agent spec: how a trajectory's score is composed
        self._lock = threading.Lock()

    def outcome(self, gen: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Each sample's score ``[B]`` and the reward function's metrics. An agent trajectory scores the
        reward function's grade of its model turns, the environment's reward, or both (``rollout.agent.reward``);
        one ended by an error scores ``rollout.agent.on_error_score``."""
        if self.agent is None or "env_reward" not in gen:
            scores, metrics = self.reward_fn(gen)
            return scores.sum(-1), dict(metrics)
        graded, metrics = self.reward_fn(gen) if self.agent.reward != "env" else (None, {})
        env = gen["env_reward"].float()
        scores = {"env": lambda: env, "reward_fn": lambda: graded.sum(-1), "sum": lambda: env + graded.sum(-1)}
        score = scores[self.agent.reward]()
        score = torch.where(gen["agent_error"].bool(), torch.full_like(score, self.agent.on_error_score), score)
        return score, dict(metrics)

    def rules(self, gen: Batch) -> tuple[Batch, dict[str, float]]:
        """``token_level_scores`` from the outcome and the overlong penalty (no worker calls)."""
        if self.agent is None:
            scores, metrics = self.reward_fn(gen)  # already token-level, at each response's last token
            metrics = dict(metrics)
        else:
            outcome, metrics = self.outcome(gen)
            scores = at_last_token(outcome, gen["response_mask"])
        if self.rule_weight != 1.0:
            scores = self.rule_weight * scores
        if self.overlong_buffer.enabled:
            penalty = self.overlong_buffer.penalty(gen["response_mask"].sum(-1), max_response_length=self.max_tokens)
            metrics["reward/overlong_penalty_mean"] = penalty.float().mean().item()
            scores = scores + at_last_token(penalty, gen["response_mask"])
        gen["token_level_scores"] = scores
        return gen, metrics

    def models(self, gen: Batch, metrics: MutableMapping[str, float] | None = None) -> Batch:
        """Add the reward model's and the weighted judge's scores (at the last response token) and the cost
        model's ``cost_scores``; the judge's ``judge/*`` metrics go into ``metrics``."""
        with self._lock:
            added = self._model_scores(gen, metrics)
            if added is not None:
                gen["token_level_scores"] = gen["token_level_scores"] + at_last_token(added, gen["response_mask"])
            if self.cost_model is not None:
                gen["cost_scores"] = self.cost_model.compute_scores(gen)["cost_scores"]
        return gen

    def baseline(self, greedy: Batch, with_models: bool) -> torch.Tensor:
        """ReMax: each greedy response's sequence reward (its weighted outcome, plus the models' scores)."""
        scores = self.rule_weight * self.outcome(greedy)[0]
        if with_models:
            with self._lock:
                added = self._model_scores(greedy, None)
            if added is not None:
                scores = scores + added
        return scores

    def _model_scores(self, gen: Batch, metrics: MutableMapping[str, float] | None) -> torch.Tensor | None:
        """The reward model's plus ``judge_weight`` times the judge's sequence scores ``[B]`` (None: no model)."""
        total = None
        if self.reward_model is not None:
            total = self.reward_model.compute_scores(gen)["rm_scores"]
        if self.judge is not None:
            clock: dict[str, float] = {}
            with timer("judge", clock):
                out = self.judge.judge(gen)
            if metrics is not None:
                metrics.update(judge_metrics(out, clock["timing_s/judge"]))
            judged = self.judge_weight * out["judge_scores"].to(gen["response_mask"].device)
            total = judged if total is None else total + judged
        return total

    def close(self) -> None:
        """Stop the reward function's worker processes."""
        close = getattr(self.reward_fn, "close", None)
        if close is not None:
            close()


class GroupFilter:
    """DAPO's dynamic sampling: only prompt groups whose rewards differ train (`algorithms.filter_groups`).

    Schedules count the groups filtered out since the trainer's last batch; more than ``limit``
    (``algorithm.filter_groups.max_num_gen_batches`` × ``data.train_batch_size``) means the data is too hard or too easy
    for the model, and `check` stops the run saying so instead of generating forever.
    """

    def __init__(self, n: int, limit: int) -> None:
        self.n, self.limit = n, limit

    def keep(self, gen: Batch) -> list[bool]:
        """Per group of ``gen`` (consecutive runs of n samples): whether its rewards differ."""
        index = torch.arange(len(gen) // self.n).repeat_interleave(self.n)
        keep, _ = algorithms.filter_groups(index, gen["token_level_scores"].sum(-1))
        return keep[:: self.n].tolist()

    def check(self, filtered: int) -> None:
        if filtered > self.limit:
            raise RuntimeError(
                f"dynamic sampling: {filtered} prompt groups with constant rewards since the trainer's last batch "
                f"(more than {self.limit}: algorithm.filter_groups.max_num_gen_batches x data.train_batch_size); the data may be "
                "too hard or too easy for the model")


class RolloutPipeline:
    """What every rollout does between a prompt batch and scored samples (see the module docstring).

    ``models_in_unit``: score with the reward/cost models inside the unit (on the schedule's thread); when
    False (an asynchronous run whose model scorers share ranks with the training roles), `finish` scores
    them on the trainer's thread as the source hands the batch over. The ReMax baseline and the group filter need the full
    score, so they require it (checked by the config schema).
    """

    def __init__(self, scorer: Scorer, sampling: SamplingParams, *, remax: bool = False,
                 group_filter: GroupFilter | None = None, models_in_unit: bool = True) -> None:
        self.scorer, self.sampling = scorer, sampling
        self.remax, self.group_filter, self.models_in_unit = remax, group_filter, models_in_unit

    @staticmethod
    def seeded(prompts: Batch, generator: torch.Generator) -> Batch:
        """Fresh per-prompt sampling seeds from ``generator``: reproducible, resumable, new every batch."""
        prompts["seed"] = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator)
        return prompts

    def run(self, prompts: Batch, generate: Generate,
            timings: MutableMapping[str, float] | None = None) -> tuple[Batch, dict[str, float]]:
        """Generate ``prompts`` (seeded), score them; with ReMax, also the greedy response to each prompt and
        its reward as ``reward_baselines``. Returns (scored samples, reward metrics); phase times
        accumulate into ``timings`` when given."""
        clock = timings if timings is not None else {}
        with timer("gen", clock, accumulate=True):
            gen = generate(prompts, self.sampling)
        if self.remax:  # one sample per prompt (checked by the config schema): row i answers prompt i
            with timer("gen_baseline", clock, accumulate=True):
                greedy = generate(prompts, self.sampling.greedy_copy())
        return self.score(gen, greedy if self.remax else None, clock)

    def score(self, gen: Batch, greedy: Batch | None = None,
              timings: MutableMapping[str, float] | None = None) -> tuple[Batch, dict[str, float]]:
        """Score generated samples (`run`'s second half; the stream schedule's repack scores a group once its
        last sample ends); with ReMax's ``greedy`` responses, their rewards as ``reward_baselines``."""
        clock = timings if timings is not None else {}
        with timer("reward", clock, accumulate=True):
            gen, metrics = self.scorer.rules(gen)
            if self.models_in_unit:
                gen = self.scorer.models(gen, metrics)
            if greedy is not None:
                gen["reward_baselines"] = self.scorer.baseline(greedy, with_models=self.models_in_unit)
        return gen, metrics

    def finish(self, batch: Batch, timings: MutableMapping[str, float]) -> Batch:
        """The trainer's share: the model scores when the unit did not add them (see the class docstring),
        timed as ``timing_s/reward_models``. Every `RolloutSource` passes its batches through here."""
        if self.models_in_unit:
            return batch
        with timer("reward_models", timings):
            return self.scorer.models(batch, timings)

    def keep(self, gen: Batch) -> list[bool]:
        """Per prompt group of ``gen``: whether it trains (every group without the DAPO filter)."""
        n = self.sampling.n
        return [True] * (len(gen) // n) if self.group_filter is None else self.group_filter.keep(gen)
