"""The mixture-of-experts config end to end: GRPO on the tiny random Qwen3-MoE (``random:`` model path), 2 ranks,
2 steps, colocated native engine, with expert parallelism (EP 2), the load-balancing loss and routing replay; and a
LoRA actor, whose adapters sit on the attention projections only (the experts are not Linear modules, so they stay
frozen)."""

from __future__ import annotations

import math
from pathlib import Path

from conftest import assert_ok, metrics_of, run_recipe

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes/configs/grpo_arithmetic_moe_cpu.yaml"


def test_grpo_on_a_tiny_moe_trains_two_steps_on_two_ranks_with_ep_and_routing_replay(tmp_path):
    proc = run_recipe(CONFIG, f"trainer.output_dir={tmp_path}", "actor.ep_size=2", "rollout.engine.record_routes=true",
                      "actor.router_replay=rollout", nproc=2)
    assert_ok(proc)
    rows = metrics_of(tmp_path)
    assert [r["training/global_step"] for r in rows] == [1, 2]
    for r in rows:
        # top-2 of 8 experts: a perfectly balanced router gives 2.0, any imbalance more (Switch's loss * E)
        assert 1.0 < r["moe/aux_loss"] < 8.0 and r["moe/expert_load/max_over_mean"] >= 1.0
        assert r["moe/routing_agreement"] > 0.99  # float32 engine and actor: the same experts, near-ties aside
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0
        assert r["perf/mfu/actor"] > 0
    assert (tmp_path / "global_step_2").is_dir()


def test_a_lora_actor_on_a_moe_adapts_the_attention_only(tmp_path):
    # random weights earn no reward: the adapters' gradient is the load-balancing loss's (through attention)
    proc = run_recipe(CONFIG, f"trainer.output_dir={tmp_path}", "trainer.total_steps=1", "actor.lora.rank=4", nproc=1)
    assert_ok(proc)
    (row,) = metrics_of(tmp_path)
    assert row["training/global_step"] == 1 and math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0

