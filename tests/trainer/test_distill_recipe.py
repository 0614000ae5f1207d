"""On-policy distillation through the recipe: a teacher role beside the actor scores the student's samples.

A teacher equal to the student gives a zero reverse KL and, with the task reward off, a zero advantage on
every token of the first step (after it the student has moved: AdamW's weight decay alone changes it). A
different teacher (another random model with the same tokenizer) gives a positive reverse KL, single turn
or agent, colocated or with the rollout on its own rank.
"""

from __future__ import annotations

import math
import re

import pytest
from conftest import assert_ok, metrics_of, run_recipe, write_config

from torchrlhf.config import ConfigError, load_config
from torchrlhf.trainer.schema import load_recipe_config, role_ranks

from test_agent_recipe import AGENT

DISTILL_METRICS = ("distill/reverse_kl", "timing_s/teacher", "perf/mfu/teacher", "perf/peak_flops/teacher")


@pytest.fixture(scope="module")
def other_teacher_dir(tmp_path_factory) -> str:
    """Another tiny random model (seed 1) with the student's tokenizer."""
    from torchrlhf.models import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("teacher"), seed=1, tokenizer_from="smollm2",
                               initializer_range=1.0))


def _run(tmp_path, tiny_model_dir, name, teacher, distill, *overrides, nproc=1, trainer=None, **sections):
    out = tmp_path / name
    cfg = write_config(tmp_path / f"{name}.yaml", tiny_model_dir, teacher={"model_path": teacher},
                       algorithm={"adv_estimator": "grpo", "distill": distill},
                       trainer={"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"], **(trainer or {})},
                       **sections)
    assert_ok(run_recipe(cfg, *overrides, nproc=nproc))
    metrics = metrics_of(out)
    assert len(metrics) == 2
    for m in metrics:
        assert all(k in m for k in DISTILL_METRICS), sorted(m)
    return metrics


def test_teacher_on_its_own_rank_equal_to_the_student_gives_zero_advantage(tiny_model_dir, tmp_path):
    """The teacher on rank 1 (``placement.teacher``), its own worker group; actor and rollout on rank 0."""
    first, second = _run(tmp_path, tiny_model_dir, "same", tiny_model_dir, {"coef": 1.0, "task_coef": 0.0}, nproc=2,
                         placement={"actor": [0], "teacher": [1]})
    ranks = role_ranks(load_recipe_config(load_config(str(tmp_path / "same.yaml")), 2), 2)
    assert ranks["teacher"] == [1] and ranks["actor"] == ranks["rollout"] == [0]  # the groups the run built
    assert first["distill/reverse_kl"] == 0.0
    assert first["critic/advantages/max"] == 0.0 and first["critic/advantages/min"] == 0.0
    assert math.isfinite(second["distill/reverse_kl"])


def test_distill_lora_single_turn_colocated_and_agent_split_async(tiny_model_dir, other_teacher_dir, tmp_path):
    """Single turn on one rank with a LoRA student (teacher, actor and rollout in one process): its teacher is
    the separate model, not the actor's adapters-off base (which equals the student at step 1, KL 0). Then
    an asynchronous agent run on 2 ranks with the rollout on its own rank (the teacher sits with the actor on
    rank 0 and scores each batch as the trainer takes it, one policy version behind at most)."""
    single = _run(tmp_path, tiny_model_dir, "single", other_teacher_dir, {"coef": 0.5},
                  actor={"lora": {"rank": 4, "alpha": 8}})
    assert all(m["distill/reverse_kl"] > 0 for m in single)
    agent = _run(tmp_path, tiny_model_dir, "agent", other_teacher_dir, {"coef": 1.0, "task_coef": 0.0}, nproc=2,
                 rollout=AGENT, placement={"actor": [0], "rollout": [1]}, trainer={"mode": "async"},
                 async_training={"max_staleness": 1})
    for m in agent:
        assert m["distill/reverse_kl"] > 0
        assert m["num_turns/mean"] >= 2 and m["agent/observation_tokens/mean"] > 0
        assert m["rollout/staleness/max"] <= 1


def test_teacher_with_another_tokenizer_is_refused(tiny_model_dir, tmp_path):
    from torchrlhf.models import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    tok.add_tokens(["<teacher_only>"])
    other = tmp_path / "other_tokenizer"
    tok.save_pretrained(other)
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, teacher={"model_path": str(other)},
                       algorithm={"distill": {"coef": 1.0}})
    with pytest.raises(ConfigError) as e:
        load_recipe_config(load_config(cfg), 1)
    msg = str(e.value)
    assert f"teacher.model_path: the teacher's tokenizer ({other}" in msg
    assert f"not the student's (actor.model_path={tiny_model_dir}" in msg
    assert "cross-tokenizer distillation is not supported" in msg


TEACHER = {"teacher": {"model_path": "${model_path}"}, "algorithm": {"distill": {"coef": 1.0}}}


@pytest.mark.parametrize("sections, world_size, message", [
    ({"algorithm": {"distill": {"coef": 1.0}}}, 1, "algorithm.distill needs a teacher section (teacher.model_path)"),
    ({"teacher": {"model_path": "${model_path}"}}, 1, "a teacher section is configured but algorithm.distill is not"),
    ({"teacher": {"model_path": "${model_path}"}, "algorithm": {"distill": {"coef": -1.0}}}, 1,
     "coef and task_coef must be >= 0"),
    ({**TEACHER, "placement": {"actor": [0], "rollout": [1], "teacher": [1]}}, 2,
     "placement.teacher [1] shares ranks with ['rollout']: a teacher sits with the actor"),
    ({**TEACHER, "placement": {"teacher": [0, 1]}}, 3, "placement.teacher [0, 1] shares ranks with ['actor', 'rollout']"),
    ({"placement": {"teacher": [1]}}, 2, "placement.teacher=[1] but this run has no teacher"),
])
def test_distill_config_errors(tiny_model_dir, tmp_path, sections, world_size, message):
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, **sections)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_recipe_config(load_config(cfg), world_size)
