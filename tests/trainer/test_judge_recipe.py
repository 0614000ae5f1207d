"""A 2-step GRPO run scored by a rule reward and a SmolLM2 judge, composed by weights, logs ``judge/*``."""

from __future__ import annotations

import math

from conftest import assert_ok, metrics_of, run_recipe, write_config

SAMPLES_PER_STEP = 4 * 4  # data.train_batch_size x rollout.n (conftest's BASE)


def test_smollm2_judge_run_logs_judge_metrics(tiny_model_dir, tmp_path):
    """A SmolLM2 judge beside the actor, sleeping between steps (its weights read back at each call)."""
    out = tmp_path / "out"
    judge = {"model_path": "smollm2", "max_tokens": 6, "batch_size": 16, "weight": 1.0, "on_failure_score": 0.0,
             "engine": {"max_seq_len": 256, "max_batch_size": 16}, "sleep": True}
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, judge=judge, reward={"weight": 0.5},
                       trainer={"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"]})
    assert_ok(run_recipe(cfg))
    metrics = metrics_of(out)
    assert [m["training/global_step"] for m in metrics] == [1, 2]
    for m in metrics:
        failures = m["judge/parse_failures"] + m["judge/timeouts"] + m["judge/too_long"]
        assert 0 <= failures <= SAMPLES_PER_STEP and failures == int(failures), m
        assert m["judge/timeouts"] == 0 and m["judge/too_long"] == 0, m  # no limit was near
        assert math.isfinite(m["judge/score_mean"]) and m["judge/time_s"] > 0, m
