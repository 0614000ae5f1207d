"""A 2-step GRPO run scored by a rule reward and a SmolLM2 judge, composed by weights, logs ``judge/*``."""

from __future__ import annotations

from conftest import assert_ok, metrics_of, run_recipe, write_config

from torchrlhf.rewards.judge import DEFAULT_TEMPLATE

# SmolLM2-135M does not follow the default chat prompt's "Reply with 'Score: 1' ..." (it answers the question
# itself: every verdict failed to parse). Given the same words as a completion prompt that ends in "Score:", it
# writes a number first: a verdict the regex reads, so a working judge parses every one of them here.
TEMPLATE = DEFAULT_TEMPLATE + "\nScore:"


def test_smollm2_judge_run_logs_judge_metrics(tiny_model_dir, tmp_path):
    """A SmolLM2 judge beside the actor, sleeping between steps (its weights read back at each call)."""
    out = tmp_path / "out"
    judge = {"model_path": "smollm2", "sampling": {"max_tokens": 6}, "batch_size": 16, "weight": 1.0, "on_failure_score": -1.0,
             "template": TEMPLATE, "apply_chat_template": False, "parser": {"regex": r"^\s*(\d+)"},
             "engine": {"max_seq_len": 256, "max_batch_size": 16}, "sleep": True}
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, judge=judge, reward={"weight": 0.5},
                       trainer={"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"]})
    assert_ok(run_recipe(cfg))
    metrics = metrics_of(out)
    assert [m["training/global_step"] for m in metrics] == [1, 2]
    for m in metrics:
        # every verdict parsed: a judge that fails (unparsed, timed out, prompt too long) scores -1 and is counted
        assert m["judge/parse_failures"] == m["judge/timeouts"] == m["judge/too_long"] == 0, m
        assert m["judge/score_mean"] >= 0 and m["judge/time_s"] > 0, m
        # the score is 0.5 x the rule reward (a fraction, in [0, 1]) + 1.0 x the judge's
        assert 0 <= m["critic/score/mean"] - m["judge/score_mean"] <= 0.5, m
