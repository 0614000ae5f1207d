"""The calibration's pieces that need no timing: the TP probe's head counts, the fixed run count that ranks of one
process group rely on, and the two-point fit."""

from __future__ import annotations

import pytest

from torchrlhf.plan.calibrate import SMOLLM2_SHAPE, _best, _fit, _heads_for_tp


def test_the_tp_probe_rounds_heads_down_to_what_tp_divides_and_keeps_the_head_size():
    # SmolLM2: 9 heads of 64 over 3 KV heads -> 8 over 2 (GQA groups of 4), head size 64 as before
    assert _heads_for_tp(SMOLLM2_SHAPE, 2) == {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
    assert _heads_for_tp(SMOLLM2_SHAPE, 3) == {}  # 9 and 3 split 3 ways already
    # no head_dim in the config: hidden / heads; 12 heads over 3 KV heads -> 12 over 2
    assert _heads_for_tp({"num_attention_heads": 12, "num_key_value_heads": 3, "hidden_size": 768}, 2) == {
        "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 64}
    # multi-head attention (no KV count): 9 heads -> 8 over 8
    assert _heads_for_tp({"num_attention_heads": 9, "hidden_size": 576}, 2) == {
        "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 64}


def test_without_a_time_floor_every_process_runs_the_same_number_of_times():
    calls = []
    _best(lambda: calls.append(1), repeats=3, min_seconds=0.0)
    assert len(calls) == 4  # a warm-up and 3 timed runs, however fast each is
    calls.clear()
    _best(lambda: calls.append(1), repeats=3, min_seconds=0.05)
    assert len(calls) > 4  # with a floor, as many as fit in it


def test_a_fit_is_the_line_through_both_points_and_through_the_origin_where_that_line_would_go_below_it():
    assert _fit(1.0, 3.0, 3.0, 7.0) == pytest.approx((1.0, 2.0))  # t = 1 + 2 x
    # the tiny model's decode on a CPU (bound ms, step ms): (1.47, 3.41) and (2.72, 7.03). The line through both
    # crosses at -0.85 ms; through the origin, the slope is (3.41 + 7.03) / (1.47 + 2.72) = 2.4916..., missing the
    # points by +0.25 and -0.25 ms, where the old clamp (intercept 0, the slope 2.896 kept) missed the first by +25 %
    intercept, slope = _fit(1.47, 3.41, 2.72, 7.03)
    assert intercept == 0.0 and slope == pytest.approx(10.44 / 4.19)
    assert slope * 1.47 - 3.41 == pytest.approx(-(slope * 2.72 - 7.03))
    assert _fit(1.0, 2.0, 2.0, 1.0) == pytest.approx((0.0, 1.0))  # a falling line: the mean rate, no negative slope
