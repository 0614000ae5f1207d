"""Rollout importance weights against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from torchrlhf.algorithms import rollout_is_weights

# Two responses; row 0 has 3 tokens, row 1 has 2 (+1 padding). Per-token ratios pi_old / pi_rollout:
# row 0: 0.5, 3.0, 1.0 ; row 1: 1.5, 4.0 | pad (the padded log-probs are junk and must be ignored).
RATIOS = torch.tensor([[0.5, 3.0, 1.0], [1.5, 4.0, 7.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ROLLOUT = torch.log(torch.tensor([[0.4, 0.1, 0.2], [0.2, 0.05, 0.1]]))
OLD = ROLLOUT + torch.log(RATIOS)


def weights(**kw):
    return rollout_is_weights(OLD, ROLLOUT, MASK, **kw)


def test_token_truncate_caps_each_ratio():
    w, raw = weights(level="token", mode="truncate", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 2.0, 1.0], [1.5, 2.0, 0.0]]))
    torch.testing.assert_close(raw, torch.tensor([[0.5, 3.0, 1.0], [1.5, 4.0, 0.0]]))


def test_token_mask_drops_tokens_above_threshold():
    w, _ = weights(level="token", mode="mask", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 0.0, 1.0], [1.5, 0.0, 0.0]]))


def test_sequence_level_uses_the_product_over_valid_tokens():
    # Products: row 0 = 0.5 * 3 * 1 = 1.5 ; row 1 = 1.5 * 4 = 6 (the padded 7 left out).
    w, raw = weights(level="sequence", mode="truncate", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(raw, torch.tensor([[1.5, 1.5, 1.5], [6.0, 6.0, 0.0]]))
    w, _ = weights(level="sequence", mode="mask", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 1.5], [0.0, 0.0, 0.0]]))


def test_long_sequence_product_does_not_overflow():
    n = 400  # ratio 2 per token: the product 2**400 overflows float32
    old = torch.full((1, n), math.log(0.5))
    rollout = torch.full((1, n), math.log(0.25))
    w, raw = rollout_is_weights(old, rollout, torch.ones(1, n), level="sequence", mode="truncate", threshold=5.0)
    assert torch.equal(w, torch.full((1, n), 5.0)) and torch.isfinite(raw).all()


@pytest.mark.parametrize("kw, match", [(dict(level="seq"), "rollout_is: must be one of"),
                                       (dict(mode="clip"), "rollout_is_mode"),
                                       (dict(threshold=0.0), "rollout_is_threshold")])
def test_bad_settings_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        weights(**kw)
