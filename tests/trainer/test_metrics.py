"""Trainer metrics computed by hand."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.data import Batch
from torchrlhf.trainer.metrics import rollout_mismatch_metrics, validation_summary


def test_rollout_probs_diff_counts_response_tokens_only():
    # Probabilities: row 0 rollout [0.5, 0.25 | pad] vs training [0.4, 0.25 | pad]; row 1 [0.9, 0.1, 0.3] vs [0.6, 0.1, 0.3].
    rollout = torch.log(torch.tensor([[0.5, 0.25, 0.7], [0.9, 0.1, 0.3]]))
    training = torch.log(torch.tensor([[0.4, 0.25, 0.1], [0.6, 0.1, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    m = rollout_mismatch_metrics(Batch({"rollout_log_probs": rollout, "old_log_probs": training, "response_mask": mask}))
    # |diffs| over the 5 valid tokens: 0.1, 0, 0.3, 0, 0 -> mean 0.08, max 0.3 (the masked 0.6 is ignored).
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.08, abs=1e-6)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.3, abs=1e-6)


def test_rollout_probs_diff_needs_both_columns():
    lp = torch.zeros(2, 3)
    assert rollout_mismatch_metrics(Batch({"old_log_probs": lp, "response_mask": torch.ones(2, 3)})) == {}
    assert rollout_mismatch_metrics(Batch({"rollout_log_probs": lp, "response_mask": torch.ones(2, 3)})) == {}


def test_validation_summary_compares_each_validation_metric():
    before = {"val/arithmetic/acc": 0.34, "val/gsm8k/acc": 0.5, "critic/score/mean": 0.1}
    after = {"val/arithmetic/acc": 0.6625, "val/gsm8k/acc": 0.5, "actor/entropy": 1.0}
    assert validation_summary(before, after) == (
        "validation before -> after training: val/arithmetic/acc 0.340 -> 0.662 (+32.2 pts), "
        "val/gsm8k/acc 0.500 -> 0.500 (+0.0 pts)"
    )
    assert validation_summary({}, after) == "" and validation_summary(before, {"critic/score/mean": 1.0}) == ""
