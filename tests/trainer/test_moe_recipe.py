"""The mixture-of-experts config end to end: GRPO on the tiny random Qwen3-MoE (``random:`` model path), 2 ranks,
2 steps, colocated native engine at TP 2 (each rank running 4 of the 8 experts), with expert parallelism (EP 2) in
training, the load-balancing loss and routing replay; and a LoRA actor, whose adapters sit on the attention
projections only (the experts are not Linear modules, so they stay frozen); and split placement with vLLM
rollouts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from conftest import assert_ok, metrics_of, run_recipe

from torchrlhf.generation import vllm_available

VLLM_OK, VLLM_WHY = vllm_available()

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes/configs/grpo_arithmetic_moe_cpu.yaml"


def test_grpo_on_a_tiny_moe_trains_two_steps_on_two_ranks_with_ep_a_tp2_engine_and_routing_replay(tmp_path):
    proc = run_recipe(CONFIG, f"trainer.output_dir={tmp_path}", "actor.ep_size=2", "rollout.tp_size=2",
                      "rollout.engine.record_routes=true", "actor.moe.router_replay=rollout", nproc=2)
    assert_ok(proc)
    rows = metrics_of(tmp_path)
    assert [r["training/global_step"] for r in rows] == [1, 2]
    for r in rows:
        # top-2 of 8 experts: a perfectly balanced router gives 2.0, any imbalance more (Switch's loss * E)
        assert 1.0 < r["moe/aux_loss"] < 8.0 and r["moe/expert_load/max_over_mean"] >= 1.0
        # float32 engine and actor: the TP engine's recorded experts are the actor's own, near-ties aside
        assert r["moe/routing_agreement"] > 0.99
        assert math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0
        assert r["perf/mfu/actor"] > 0
    assert (tmp_path / "global_step_2").is_dir()


def test_a_lora_actor_on_a_moe_adapts_the_attention_only(tmp_path):
    # random weights earn no reward: the adapters' gradient is the load-balancing loss's (through attention)
    proc = run_recipe(CONFIG, f"trainer.output_dir={tmp_path}", "trainer.total_steps=1", "actor.lora.rank=4", nproc=1)
    assert_ok(proc)
    (row,) = metrics_of(tmp_path)
    assert row["training/global_step"] == 1 and math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0



@pytest.mark.skipif(not VLLM_OK, reason=f"vLLM is not importable here: {VLLM_WHY}")
def test_split_vllm_rollouts_of_a_moe_sample_with_the_trained_experts(tmp_path):
    """The actor on rank 0, vLLM on rank 1: after each update the stacked experts are broadcast and loaded into
    vLLM's per-expert layout. Two mini-batches make the actor recompute log-probs, so every step compares vLLM's
    sampling log-probs with the training forward's; the load-balancing loss alone (random weights earn no
    reward), at a large learning rate, moves the weights, so experts that did not reach vLLM would show."""
    proc = run_recipe(CONFIG, f"trainer.output_dir={tmp_path}", "placement.actor=[0]", "placement.rollout=[1]",
                      "rollout.engine._component_=torchrlhf.generation.VLLMEngine", "actor.batching.ppo_mini_batch_size=2",
                      "actor.optim.lr=3e-2", "actor.moe.aux_loss_coef=1.0", "trainer.total_steps=3", nproc=2)
    assert_ok(proc)
    rows = metrics_of(tmp_path)
    assert [r["rollout/weight_version"] for r in rows] == [0, 1, 2]
    assert all(r["training/rollout_probs_diff_max"] < 1e-3 for r in rows), rows
    assert len({round(r["moe/aux_loss"], 4) for r in rows}) == 3  # the router moved every step


def test_async_stream_training_of_a_moe(tmp_path):
    """Rollouts on rank 1 stream into the actor on rank 0 one step behind (max_staleness 1), corrected by token
    importance weights."""
    proc = run_recipe(CONFIG, f"trainer.output_dir={tmp_path}", "placement.actor=[0]", "placement.rollout=[1]",
                      "trainer.mode=async", "async_training.schedule=stream", "async_training.max_staleness=1",
                      "async_training.prompts_per_call=2", "actor.loss.rollout_is=token", nproc=2)
    assert_ok(proc)
    rows = metrics_of(tmp_path)
    assert [r["training/global_step"] for r in rows] == [1, 2]
    assert max(r["rollout/staleness/max"] for r in rows) <= 1
    assert all(math.isfinite(r["moe/aux_loss"]) for r in rows)
