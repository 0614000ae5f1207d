"""The simulator's arithmetic on cases computed by hand: one stage of each kind, and a step colocated against split."""

from __future__ import annotations

import dataclasses

import pytest

from torchrlhf.plan.hardware import DecodeCost, HardwareProfile, Link, PassCost
from torchrlhf.plan.simulate import (
    Mapping,
    Problem,
    Role,
    Workload,
    collective_s,
    decode_weights,
    generate_s,
    pass_s,
    step_estimate,
    weight_sync_s,
)
from torchrlhf.plan.simulate import _stages
from torchrlhf.trainer.explain import ModelShape
from torchrlhf.utils.flops import TransformerFlops

# 2 layers, 1000 block weights, 2 heads of 4, hidden 8, vocabulary 10; 2000 parameters in 5 tensors
FLOPS = TransformerFlops(layers=2, block_params=1000, heads=2, head_dim=4, hidden=8, head_out=10)
MODEL = ModelShape(params=2000, layers=2, hidden=8, vocab=10, kv_heads=1, head_dim=4, flops=FLOPS, tensors=5)


def profile(units: int | None = None, **changes) -> HardwareProfile:
    fields = dict(name="hand", source="test", memory_gib=1.0, matmul_tflops={"float32": 1.0},
                  memory_bandwidth_gbps=1.0, train=PassCost(0.25, 0.5), forward=PassCost(0.5, 0.1),
                  decode=DecodeCost(0.5, 0.01), intra_node=Link(2.0, 100.0), inter_node=Link(1.0, 1000.0),
                  step_overhead_s=0.0, compute_units_per_node=units)
    fields.update(changes)
    return HardwareProfile(**fields)


def test_a_forward_pass_is_its_calls_plus_its_flops_at_the_forward_rate():
    # 4 samples of 3 + 2 tokens on one rank, micro-batches of 2: 2 calls.
    # tokens 20; keys 4 * (1 + 2 + 3 + 4 + 5) = 60; scored 4 * 2 = 8
    # FLOPs 2 * 1000 * 20 + 4 * 2 * 2 * 4 * 60 + 2 * 8 * 10 * 8 = 40 000 + 3 840 + 1 280 = 45 120
    seconds = pass_s(MODEL, Role(ranks=1, log_prob_micro=2), profile(), dtype="float32", samples=4, prompt_len=3,
                     response_len=2, train=False, node_size=1, busy=1)
    assert seconds == pytest.approx(2 * 0.1 + 45_120 / (1e12 * 0.5), rel=1e-12)


def test_a_training_pass_counts_three_forwards_the_optimizer_and_fsdp_traffic():
    # 2 ranks (dp 2), 4 samples of 3 + 2 tokens, micro 1: 2 samples per rank -> 2 calls; one optimizer step.
    # FLOPs 3 * 45 120 over 2 ranks at 0.25 of 1 TFLOP/s; AdamW 2000 / 2 parameters * 28 bytes at 1 GB/s;
    # FSDP2 per call: 2000 * (2 - 1) / 2 parameters * (2 gathers * 4 + 4) bytes and 2 layers * 3 collectives of 100 µs
    seconds = pass_s(MODEL, Role(ranks=2, micro=1), profile(), dtype="float32", samples=4, prompt_len=3,
                     response_len=2, train=True, node_size=2, busy=2, optimizer_steps=1)
    compute = 2 * 0.5 + 3 * 45_120 / 2 / (1e12 * 0.25) + 1000 * 28 / 1e9
    fsdp = 2 * (6 * 100e-6 + 1000 * 12 / 2e9)
    assert seconds == pytest.approx(compute + fsdp, rel=1e-12)


def test_an_fsdp_group_computes_its_passes_fsdp_slowdown_times_slower_but_not_its_optimizer_step():
    # the case above with fsdp_slowdown 1.5 and a CPU node of 2 units contended 1.2x when both compute: the calls and
    # FLOPs take 1.2 * 1.5 times as long, the AdamW step 1.2 times, the traffic as before
    hw = profile(units=2, fsdp_slowdown=1.5, concurrent_slowdown=1.2)
    seconds = pass_s(MODEL, Role(ranks=2, micro=1), hw, dtype="float32", samples=4, prompt_len=3,
                     response_len=2, train=True, node_size=2, busy=2, optimizer_steps=1)
    passes = (2 * 0.5 + 3 * 45_120 / 2 / (1e12 * 0.25)) * 1.2 * 1.5
    assert seconds == pytest.approx(passes + 1000 * 28 / 1e9 * 1.2 + 2 * (6 * 100e-6 + 1000 * 12 / 2e9), rel=1e-12)
    # one rank: no FSDP2, no slowdown
    alone = pass_s(MODEL, Role(ranks=1, micro=1), hw, dtype="float32", samples=4, prompt_len=3, response_len=2,
                   train=True, node_size=2, busy=1, optimizer_steps=1)
    assert alone == pytest.approx(4 * 0.5 + 3 * 45_120 / (1e12 * 0.25) + 2000 * 28 / 1e9, rel=1e-12)


def test_tp_all_reduces_use_the_profiles_tp_link_inside_a_node():
    # a forward over 2 ranks of TP 2 (dp 1): 4 samples in 4 calls, half of 45 120 FLOPs per rank. All-reduces: 2 per
    # layer per call, 4 calls x 2 x 2 layers = 16; bytes: the 20 tokens x hidden 8 x 4 bytes x 2 x 1/2 = 640 per
    # layer-reduce, x 2 x 2 layers = 2 560; on the tp link (0.5 GB/s, 1 ms)
    kw = dict(dtype="float32", samples=4, prompt_len=3, response_len=2, train=False, node_size=2, busy=2)
    compute = 4 * 0.1 + 45_120 / 2 / (1e12 * 0.5)
    tp = pass_s(MODEL, Role(ranks=2, tp=2), profile(tp=Link(0.5, 1000.0)), **kw)
    assert tp == pytest.approx(compute + 16 * 1e-3 + 2_560 / 0.5e9, rel=1e-12)
    node = pass_s(MODEL, Role(ranks=2, tp=2), profile(), **kw)  # no tp link: the node's (2 GB/s, 100 µs)
    assert node == pytest.approx(compute + 16 * 100e-6 + 2_560 / 2e9, rel=1e-12)


def test_ranks_beyond_a_cpus_compute_units_share_them():
    alone = pass_s(MODEL, Role(ranks=1), profile(units=1), dtype="float32", samples=4, prompt_len=3, response_len=2,
                   train=False, node_size=2, busy=1)
    shared = pass_s(MODEL, Role(ranks=1), profile(units=1), dtype="float32", samples=4, prompt_len=3,
                    response_len=2, train=False, node_size=2, busy=2)
    assert shared == pytest.approx(2 * alone, rel=1e-12)  # two ranks on one unit: each at half speed, calls too


def test_decode_is_its_steps_at_the_roofline_bound_plus_a_prefill():
    # one replica, 2 prompts x n 2 = 4 slots, prompts of 3 tokens, 5 decode steps of a 4-token response.
    # prefill: 2 prompts of 3 tokens: FLOPs 2 * 1000 * 6 + 4 * 2 * 2 * 4 * (2 * 6) + 2 * 8 * 10 * 2 = 13 088
    # a step reads 2000 * 4 bytes of weights + 4 slots * (3 + 2) keys * (2 * 2 * 1 * 4 * 4 = 64 bytes) = 9 280 bytes
    #   (9.28 µs at 1 GB/s) against FLOPs 2 * 1000 * 4 + 4 * 2 * 2 * 4 * 20 + 2 * 8 * 10 * 4 = 9 920 (9.92 ps): memory
    seconds = generate_s(MODEL, Role(ranks=1), profile(), dtype="float32", prompts=2, n=2, prompt_len=3,
                         decode_steps=5, response_len=4, max_slots=8, node_size=1, busy=1)
    prefill = 0.1 + 13_088 / (1e12 * 0.5)
    step = 0.01 + 9_280 / 1e9 / 0.5
    assert seconds == pytest.approx(prefill + 5 * step, rel=1e-12)


def test_a_cpu_decode_step_adds_its_bytes_and_flops_and_samples_every_slot_over_the_vocabulary():
    # the case above on a CPU (one compute unit): the step's 9 280 bytes at 1 GB/s and its 9 920 FLOPs at 1 TFLOP/s
    # add up, and the sampler's 2 ns per logit draws a token for each of the 4 slots over the 10-token vocabulary,
    # in the prefill (every sample's first token) and in every step
    seconds = generate_s(MODEL, Role(ranks=1), profile(units=1, sample_ns_per_logit=2.0), dtype="float32", prompts=2,
                         n=2, prompt_len=3, decode_steps=5, response_len=4, max_slots=8, node_size=1, busy=1)
    sample = 4 * 10 * 2e-9
    prefill = 0.1 + 13_088 / (1e12 * 0.5) + sample
    step = 0.01 + (9_280 / 1e9 + 9_920 / 1e12) / 0.5 + sample
    assert seconds == pytest.approx(prefill + 5 * step, rel=1e-12)


def test_a_tp_replica_splits_the_blocks_and_runs_the_whole_lm_head_on_each_rank():
    # the case above on one replica of TP 2; the head is hidden 8 x vocabulary 10 = 80 weights, on both ranks.
    # prefill per rank: (2 * 1000 * 6 + 4 * 2 * 2 * 4 * 12) / 2 + 2 * 8 * 10 * 2 = 6 384 + 320 = 6 704 FLOPs
    # a step reads ((2000 - 80) * 4 + 1 280 bytes of KV) / 2 + 80 * 4 = 4 800 bytes (memory-bound as above),
    #   then 2 all-reduces per layer of 4 slots x hidden 8 x 4 bytes x 2 on the node's link (2 GB/s, 100 µs)
    seconds = generate_s(MODEL, Role(ranks=2, tp=2), profile(), dtype="float32", prompts=2, n=2, prompt_len=3,
                         decode_steps=5, response_len=4, max_slots=8, node_size=2, busy=2)
    prefill = 0.1 + 6_704 / (1e12 * 0.5)
    step = 0.01 + 4_800 / 1e9 / 0.5 + 4 * 100e-6 + 256 / 2e9
    assert seconds == pytest.approx(prefill + 5 * step, rel=1e-12)
    # the engine's own TP link (plain tensors) where the profile has one, else the training TP's (DTensor)
    kw = dict(dtype="float32", prompts=2, n=2, prompt_len=3, decode_steps=5, response_len=4, max_slots=8, node_size=2,
              busy=2)
    engine = generate_s(MODEL, Role(ranks=2, tp=2), profile(tp=Link(0.5, 5000.0), tp_engine=Link(1.0, 300.0)), **kw)
    assert engine == pytest.approx(prefill + 5 * (0.01 + 4_800 / 1e9 / 0.5 + 4 * 300e-6 + 256 / 1e9), rel=1e-12)
    training = generate_s(MODEL, Role(ranks=2, tp=2), profile(tp=Link(0.5, 5000.0)), **kw)
    assert training == pytest.approx(prefill + 5 * (0.01 + 4_800 / 1e9 / 0.5 + 4 * 5000e-6 + 256 / 0.5e9), rel=1e-12)


def test_decode_waves_when_samples_exceed_the_slots():
    one_wave = generate_s(MODEL, Role(ranks=1), profile(), dtype="float32", prompts=2, n=2, prompt_len=3,
                          decode_steps=5, response_len=4, max_slots=4, node_size=1, busy=1)
    two_waves = generate_s(MODEL, Role(ranks=1), profile(), dtype="float32", prompts=4, n=2, prompt_len=3,
                           decode_steps=5, response_len=4, max_slots=4, node_size=1, busy=1)
    assert two_waves == pytest.approx(2 * one_wave, rel=1e-12)


def test_a_collective_is_latency_plus_bytes_over_bandwidth_on_the_link_it_crosses():
    hw = profile()
    assert collective_s(hw.intra_node, 4e9, calls=3) == pytest.approx(3 * 100e-6 + 2.0)
    # split: the actor's rank 0 broadcasts 2000 x 4 bytes to rank 1, layer by layer (2 calls); ranks 0 and 1 on one
    # node of 2 ranks, then on two nodes of 1
    split = weight_sync_s(MODEL, Role(ranks=1), Role(ranks=1, first=1), hw, dtype="float32", node_size=2)
    assert split == pytest.approx(2 * 100e-6 + 8000 / 2e9)
    across = weight_sync_s(MODEL, Role(ranks=1), Role(ranks=1, first=1), hw, dtype="float32", node_size=1)
    assert across == pytest.approx(2 * 1000e-6 + 8000 / 1e9)
    # an actor on 2 ranks first gathers each of its 5 tensors whole (half of 2000 float32 parameters arrive), bf16
    # broadcast
    sharded = weight_sync_s(MODEL, Role(ranks=2), Role(ranks=1, first=2), hw, dtype="bfloat16", node_size=4)
    assert sharded == pytest.approx(5 * 100e-6 + 1000 * 4 / 2e9 + 2 * 100e-6 + 2000 * 2 / 2e9)
    # colocated on 2 ranks: each gathers the other half, one collective per tensor (5), then its engine takes back
    # 2000 x 4 bytes of weights and 10 tokens x (2 layers x K and V x 1 KV head x 4 wide x 4 bytes = 64) of KV cache
    colocated = weight_sync_s(MODEL, Role(ranks=2), Role(ranks=2), hw, dtype="float32", node_size=2, kv_tokens=10)
    assert colocated == pytest.approx(5 * 100e-6 + 1000 * 4 / 2e9 + (8000 + 640) / 1e9)
    # FSDP2's calibrated link carries the gathers, and a calibrated resume rate the engine's fill; on one rank
    # (dp 1) there is nothing to gather
    hw = profile(fsdp=Link(0.5, 10.0), engine_resume_gbps=4.0)
    colocated = weight_sync_s(MODEL, Role(ranks=2), Role(ranks=2), hw, dtype="float32", node_size=2, kv_tokens=10)
    assert colocated == pytest.approx(5 * 10e-6 + 1000 * 4 / 0.5e9 + (8000 + 640) / 4e9)
    alone = weight_sync_s(MODEL, Role(ranks=1), Role(ranks=1), hw, dtype="float32", node_size=2, kv_tokens=10)
    assert alone == pytest.approx((8000 + 640) / 4e9)


# the same model as a mixture of experts: 1200 of its 2000 parameters are 4 routed experts per layer, 2 per token
MOE = dataclasses.replace(MODEL, model_type="qwen3_moe", experts=4, top_k=2, expert_params=1200)


def test_expert_parallelism_gathers_a_ranks_own_experts_and_adds_two_all_to_alls_per_layer_pass():
    # 4 ranks (dp 4), 4 samples of 3 + 2 tokens, micro 1: 1 sample per rank -> 1 call; float32.
    # FSDP2 per call, EP 1: 2000 * 3/4 = 1500 parameters * 12 bytes; EP 2: the 800 dense ones over 4 ranks
    #   (800 * 3/4 = 600) and the rank's 600 experts over the 2 ranks holding them (600 * 1/2 = 300): 900 * 12 bytes
    # all-to-all, EP 2: 20 tokens / 4 ranks * 2 copies * 8 wide * 4 bytes * 1/2 leaving = 160 bytes, 4 per layer
    #   (dispatch and combine, forward and backward) over 2 layers: 8 calls of 100 µs and 1 280 bytes at 2 GB/s
    kw = dict(dtype="float32", samples=4, prompt_len=3, response_len=2, train=True, node_size=4, busy=4)
    ep1 = pass_s(MOE, Role(ranks=4), profile(), **kw)
    ep2 = pass_s(MOE, Role(ranks=4, ep=2), profile(), **kw)
    assert ep2 - ep1 == pytest.approx((900 - 1500) * 12 / 2e9 + 8 * 100e-6 + 1280 / 2e9, rel=1e-9)
    # a dense model's gathers are as before: the 2000 parameters over 4 ranks
    assert pass_s(MODEL, Role(ranks=4), profile(), **kw) == pytest.approx(ep1, rel=1e-12)


def test_a_moe_decode_step_reads_the_experts_its_tokens_were_routed_to():
    # each token picks 2 of 4 experts: one slot reads half of them, 3 slots miss an expert with (1/2)^3 = 1/8
    assert decode_weights(MOE, 1) == pytest.approx(800 + 1200 / 2)
    assert decode_weights(MOE, 3) == pytest.approx(800 + 1200 * 7 / 8)
    assert decode_weights(MODEL, 1) == 2000
    # a one-slot generation of the MoE decodes as a dense model of 1 400 parameters would
    kw = dict(dtype="float32", prompts=1, n=1, prompt_len=3, decode_steps=5, response_len=4, max_slots=8,
              node_size=1, busy=1)
    assert generate_s(MOE, Role(ranks=1), profile(), **kw) == pytest.approx(
        generate_s(dataclasses.replace(MODEL, params=1400), Role(ranks=1), profile(), **kw), rel=1e-12)


def _problem() -> Problem:
    return Problem(models={"actor": MODEL}, dtypes={"actor": "float32", "rollout": "float32"},
                   workload=Workload(prompts=2, n=2, prompt_len=3, response_len=4, longest_response=4),
                   mini_batches={"actor": 1}, epochs={"actor": 1}, old_log_prob=False, reference=True,
                   shared_prefix={"actor": False, "critic": False}, max_slots=8, max_seq_len=7)


def test_a_synchronous_step_adds_its_stages_and_an_asynchronous_one_takes_the_slower_side():
    hw = profile(step_overhead_s=0.3)
    colocated = Mapping({"actor": Role(2), "rollout": Role(2)})
    split = Mapping({"actor": Role(1), "rollout": Role(1, first=1)})
    streamed = Mapping({"actor": Role(1), "rollout": Role(1, first=1)}, mode="async", max_staleness=1,
                       prompts_per_call=2)
    for mapping in (colocated, split):
        est = step_estimate(_problem(), mapping, hw, node_size=2)
        assert [s.name for s in est.stages] == ["generate", "ref", "update_actor", "weight_sync"]
        assert est.seconds == pytest.approx(sum(s.seconds for s in est.stages) + 0.3, rel=1e-12)
    sync = step_estimate(_problem(), split, hw, node_size=2)
    async_ = step_estimate(_problem(), streamed, hw, node_size=2)
    gen = async_.by_stage()["generate"]
    assert gen == pytest.approx(sync.by_stage()["generate"], rel=1e-12)  # one call of both prompts
    train = sum(v for k, v in async_.by_stage().items() if k != "generate")
    assert async_.seconds == pytest.approx(max(gen, train) + 0.3, rel=1e-12)
    assert async_.seconds < sync.seconds
    # split: one engine decodes all 4 samples; colocated, two engines decode 2 each
    assert sync.by_stage()["generate"] > step_estimate(_problem(), colocated, hw, node_size=2).by_stage()["generate"]


def _both_sides_step_by_step(alone, beside, steps: int = 200_000) -> tuple[float, float]:
    """A slow loop: the training stages one after another and generation from the start, each progressing at its
    rate beside the other side while the other still runs, at its rate alone after; (generation, training) s."""
    gen = [(a.seconds, b.seconds) for a, b in zip(alone, beside) if a.name == "generate"][0]
    train = [(a.seconds, b.seconds) for a, b in zip(alone, beside) if a.name != "generate"]
    dt = (sum(b for _, b in train) + gen[1]) / steps
    t, gen_left, stage, stage_left, gen_end, train_end = 0.0, 1.0, 0, 1.0, None, None
    while gen_end is None or train_end is None:
        t += dt
        if gen_end is None:
            gen_left -= dt / (gen[1] if train_end is None else gen[0])
            gen_end = t if gen_left <= 0 else None
        if train_end is None:
            a, b = train[stage]
            stage_left -= dt / (b if gen_end is None else a)
            if stage_left <= 0:
                stage, stage_left = stage + 1, 1.0
                train_end = t if stage == len(train) else None
    return gen_end, train_end


@pytest.mark.parametrize("decode_steps", [4, 4000], ids=["training-longer", "generation-longer"])
def test_async_ranks_sharing_a_cpu_slow_each_other_only_while_both_sides_run(decode_steps):
    """Two ranks on one compute unit: a stage computing beside the other side takes twice as long (`share`).
    Generation starts with the step; the step's times equal a slow step-by-step loop of both sides."""
    problem = dataclasses.replace(_problem(), workload=Workload(prompts=2, n=2, prompt_len=3, response_len=4,
                                                                longest_response=decode_steps))
    hw = profile(units=1)
    streamed = Mapping({"actor": Role(1), "rollout": Role(1, first=1)}, mode="async", max_staleness=1,
                       prompts_per_call=2)
    alone = _stages(problem, streamed, hw, node_size=2, busy=lambda r: 1)
    beside = _stages(problem, streamed, hw, node_size=2, busy=lambda r: 2)
    assert all(b.seconds > a.seconds for a, b in zip(alone, beside) if a.name != "weight_sync")  # the unit shared
    est = step_estimate(problem, streamed, hw, node_size=2)
    generation, training = _both_sides_step_by_step(alone, beside)
    assert (est.generation_s > est.training_s) == (decode_steps == 4000)
    assert est.generation_s == pytest.approx(generation, rel=1e-3)
    assert est.training_s == pytest.approx(training, rel=1e-3)
    assert est.seconds == pytest.approx(max(generation, training), rel=1e-3)
