"""The calibration's pieces that need no timing: the TP probe's head counts and the fixed run count that ranks of one
process group rely on."""

from __future__ import annotations

from torchrlhf.plan.calibrate import SMOLLM2_SHAPE, _best, _heads_for_tp


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
