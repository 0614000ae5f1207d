"""The calibration's pieces that need no timing: the TP probe's head counts, the fixed run count that ranks of one
process group rely on, the two-point fit, and the FSDP2 fit on passes built by hand from its model."""

from __future__ import annotations

import pytest

from torchrlhf.plan.calibrate import ROWS, SMOLLM2_SHAPE, _best, _fit, _heads_for_tp, fit_fsdp


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


def test_the_fsdp_fit_recovers_the_latency_bandwidth_and_slowdown_its_passes_were_built_from():
    # 1000 bfloat16 parameters in 2 layers. Per sharded pass, half cross: train 500 * (2 * 2 + 4) = 4000 bytes in
    # 6 collectives, forward 500 * 2 = 1000 bytes in 2. Built with latency 0.01 s, 1e-4 s per byte (10 kB/s),
    # contention 1.25 and a slowdown of 1.2 beyond it: train 0.06 + 0.4 = 0.46 s, forward 0.02 + 0.1 = 0.12 s
    small, large = ROWS
    alone = {(True, small): 1.0, (True, large): 9.0, (False, small): 0.3, (False, large): 2.7}
    fixed = {True: 0.46, False: 0.12}
    sharded = {(train, r): 1.25 * 1.2 * t + fixed[train] for (train, r), t in alone.items()}
    link, slowdown = fit_fsdp(alone, sharded, params=1000, layers=2, width=2, contention=1.25)
    assert slowdown == pytest.approx(1.2)
    assert link.latency_us == pytest.approx(0.01e6)
    assert link.bandwidth_gbps == pytest.approx(1e4 / 1e9)
    # the same passes read without the contention: it is all slowdown (1.5)
    assert fit_fsdp(alone, sharded, params=1000, layers=2, width=2)[1] == pytest.approx(1.5)


def test_sharded_passes_that_grow_slower_than_alone_have_no_slowdown_and_all_their_extra_time_as_traffic():
    # float32 (width 4): train 500 * 12 = 6000 bytes in 6 collectives, forward 2000 bytes in 2: the same ratio, so
    # latency and bandwidth cannot be told apart
    small, large = ROWS
    alone = {(True, small): 1.0, (True, large): 9.0, (False, small): 0.3, (False, large): 2.7}
    sharded = {(True, small): 3.0, (True, large): 10.5, (False, small): 0.8, (False, large): 3.0}
    link, slowdown = fit_fsdp(alone, sharded, params=1000, layers=2, width=4)
    assert slowdown == 1.0  # grew 7.5 + 2.2 s where alone grew 8 + 2.4: clamped, never a speed-up
    # what is left: train (2.0 + 1.5) / 2 = 1.75 s, forward (0.5 + 0.3) / 2 = 0.4 s; the 2x2 solve's determinant
    # 6 * 2000 - 2 * 6000 is 0 -> all of the training pass's as bandwidth
    assert link.latency_us == 0.0
    assert link.bandwidth_gbps == pytest.approx(6000 / 1.75 / 1e9)
