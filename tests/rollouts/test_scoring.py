"""Every rollout source hands the trainer fully scored batches, whatever the schedule, the placement and the
scorers.

Each cell builds the rollout source as the recipe does (`build_rollouts` over a real recipe config), over a
fake rollout group and fake reward / cost models whose scores are known functions of the prompt index. It
checks the columns the trainer reads: ``token_level_scores`` (the rule reward plus the reward model's score
at each response's last token) and ``cost_scores``. A model that shares ranks with the actor must be called
on the trainer's thread in an asynchronous run (its calls would interleave with training collectives on a
rollout thread).
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

from torchrlhf.config import load_config
from torchrlhf.data import Batch
from torchrlhf.trainer.build import build_rollouts, build_scorer
from torchrlhf.trainer.schema import load_recipe_config

from fakes import B, N, R, FakeRollouts, PromptSource

# the recipe tests' config writer (a small GRPO config over a model directory)
_spec = importlib.util.spec_from_file_location("recipe_configs", Path(__file__).parents[1] / "trainer" / "conftest.py")
_recipe_configs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_recipe_configs)
write_config = _recipe_configs.write_config

RULE = 1.0  # the rule reward of every sample, at its last token


def rule_reward(gen: Batch) -> tuple[torch.Tensor, dict[str, float]]:
    scores = torch.zeros(len(gen), R)
    scores[:, -1] = RULE
    return scores, {}


def rm_score(index: torch.Tensor) -> torch.Tensor:
    return 0.5 * index.float() + 0.25


def cost_score(index: torch.Tensor) -> torch.Tensor:
    return 2.0 - 0.125 * index.float()


def judge_score(index: torch.Tensor) -> torch.Tensor:
    return 1.0 - 0.25 * index.float()


class FakeJudge:
    """A judge group: `JudgeWorker.judge`'s columns, scores a known function of the prompt index, the first
    sample's verdict unparseable."""

    def __init__(self) -> None:
        self.threads = set()

    def judge(self, batch: Batch) -> Batch:
        self.threads.add(threading.current_thread())
        n = len(batch)
        failed = torch.arange(n) == 0
        return Batch({"judge_scores": judge_score(torch.tensor(batch["index"])), "judge_parse_failed": failed,
                      "judge_timed_out": torch.zeros(n, dtype=torch.bool),
                      "judge_too_long": torch.zeros(n, dtype=torch.bool)})


class FakeModel:
    """A reward or cost model group: ``compute_scores`` of a known function of each sample's prompt index,
    recording the threads it was called on."""

    def __init__(self, key: str, fn) -> None:
        self.key, self.fn, self.threads = key, fn, set()

    def compute_scores(self, batch: Batch) -> dict[str, torch.Tensor]:
        self.threads.add(threading.current_thread())
        return {self.key: self.fn(torch.tensor(batch["index"]))}


SCHEDULES = {"sync": {"trainer": {"mode": "sync"}},
             "stream": {"trainer": {"mode": "async"}, "async_training": {"schedule": "stream", "max_staleness": 1}},
             "deterministic": {"trainer": {"mode": "async"},
                               "async_training": {"schedule": "deterministic", "max_staleness": 1}}}
PLACEMENTS = {"colocated": (2, {}), "split": (3, {"actor": [0], "rollout": [1, 2]})}
MODEL = {"model_path": "${model_path}"}
# scorer -> (sections, where the model sits: ranks for placement.<role>, None for the actor's)
SCORERS = {"rules": ({}, None),
           "rm_on_actor_ranks": ({"reward_model": MODEL}, None),
           "rm_on_rollout_ranks": ({"reward_model": MODEL}, [2]),
           "cost_model": ({"cost_model": MODEL}, None),
           # rewards composed by weights: 0.5 * rule + 2 * judge
           "judge_weighted": ({"judge": {**MODEL, "weight": 2.0}, "reward": {"weight": 0.5}}, None)}
CELLS = [(s, p, c) for s in SCHEDULES for p in PLACEMENTS for c in SCORERS
         if (s == "sync" or p == "split")  # asynchronous training needs rollout ranks of their own
         and not (p == "colocated" and c == "rm_on_rollout_ranks")]  # the same ranks as the actor's


@pytest.mark.parametrize("schedule,placement,scorer", CELLS, ids=["-".join(c) for c in CELLS])
def test_every_source_yields_fully_scored_batches(tmp_path, monkeypatch, schedule, placement, scorer):
    world, ranks = PLACEMENTS[placement]
    sections, model_ranks = SCORERS[scorer]
    role = next(iter(sections), None)
    roles = [r for r in sections if r != "reward"]
    placement_cfg = dict(ranks) | ({role: model_ranks} if model_ranks is not None else {})
    trainer = {"total_steps": 3, "output_dir": str(tmp_path), **SCHEDULES[schedule]["trainer"]}
    extra = {k: v for k, v in SCHEDULES[schedule].items() if k != "trainer"}
    cfg = load_recipe_config(load_config(write_config(
        tmp_path / "c.yaml", str(tmp_path), trainer=trainer, placement=placement_cfg,
        rollout={"n": N, "max_tokens": R}, data={"train_batch_size": B},
        actor={"batching": {"ppo_mini_batch_size": B, "ppo_micro_batch_size_per_device": 2}}, **extra, **sections)), world)

    # no actor weights to move to the fake replicas, which ignore them
    monkeypatch.setattr("torchrlhf.trainer.build.WeightSync", lambda *args, **kwargs: lambda *a, **kw: {})
    models = {"reward_model": FakeModel("rm_scores", rm_score), "cost_model": FakeModel("cost_scores", cost_score),
              "judge": FakeJudge()}
    groups = {"rollout": FakeRollouts(dp_size=len(ranks.get("rollout", [0])), slow=0.002), "actor": None,
              **{r: models[r] for r in roles}}
    source = build_rollouts(cfg, world, groups, build_scorer(cfg, groups, rule_reward), PromptSource())

    source.start(0)
    try:
        for step in range(1, 4):
            batch, metrics = source.next_batch(step, step - 1)
            index = torch.tensor(batch["index"])
            expected = RULE + (rm_score(index) if "reward_model" in sections else torch.zeros(len(batch)))
            if "judge" in sections:
                expected = 0.5 * RULE + 2.0 * judge_score(index)
                assert metrics["judge/parse_failures"] >= 1 and metrics["judge/time_s"] >= 0, metrics
            torch.testing.assert_close(batch["token_level_scores"].sum(-1), expected)
            torch.testing.assert_close(batch["token_level_scores"][:, :-1], torch.zeros(len(batch), R - 1))
            if "cost_model" in sections:
                torch.testing.assert_close(batch["cost_scores"], cost_score(index))
            else:
                assert "cost_scores" not in batch
            source.publish(step)
    finally:
        source.stop()

    for r in roles:
        assert models[r].threads, f"the {r} never scored"
        if schedule != "sync" and model_ranks is None:  # with the actor: only the trainer's thread may call it
            assert models[r].threads == {threading.main_thread()}
