"""The dry-run explainer: batch arithmetic and memory figures worked out by hand, errors as a real run's."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
import transformers
from conftest import RECIPE, ROOT, write_config

from torchrlhf.config import ConfigError, load_config
from torchrlhf.trainer.explain import _rank_peak, explain, model_shape
from torchrlhf.trainer.schema import load_recipe_config
from torchrlhf.utils.flops import TransformerFlops


def _hf_params(path: str) -> int:
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return len(torch.nn.utils.parameters_to_vector(model.parameters()))


def test_parameter_count_matches_the_loaded_model(tiny_model_dir):
    assert model_shape(tiny_model_dir).params == _hf_params(tiny_model_dir)


def test_tensor_count_is_a_llamas_nine_per_layer_and_the_embedding_norm_and_untied_head(tiny_model_dir):
    """What a weight sync moves one by one: per layer q, k, v, o, gate, up, down and two norms; then the embedding,
    the final norm, and the LM head unless it is the embedding's tensor."""
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "llama"
    want = 9 * config.num_hidden_layers + 2 + (0 if config.tie_word_embeddings else 1)
    assert model_shape(tiny_model_dir).tensors == want


def test_a_value_models_shape_has_the_backbone_and_a_one_output_head(tiny_model_dir):
    """A critic or a reward model: transformers' bare backbone plus Linear(hidden, 1) with its bias, and a scored
    position costs 2 · hidden FLOPs where the LM head's cost 2 · hidden · vocab."""
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    backbone = sum(p.numel() for p in transformers.AutoModel.from_pretrained(tiny_model_dir).parameters())
    shape = model_shape(tiny_model_dir, value_head=True)
    assert shape.params == backbone + config.hidden_size + 1
    lm = model_shape(tiny_model_dir).flops
    assert shape.flops.forward(0, 0, 10) == 2 * config.hidden_size * 10
    assert lm.forward(0, 0, 10) == 2 * config.hidden_size * config.vocab_size * 10
    assert shape.flops.forward(7, 30, 0) == lm.forward(7, 30, 0)  # the blocks are the same


def test_batch_arithmetic_and_memory_per_rank(tiny_model_dir, tmp_path):
    # 8 prompts x 4 = 32 samples; mini-batches of 4 prompts -> 2 per step, x 2 epochs = 4 optimizer steps;
    # per rank per mini-batch 4 * 4 / 4 ranks = 4 samples, micro-batches of 2 -> 2 accumulation steps.
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir,
                            data={"train_batch_size": 8}, rollout={"n": 4},
                            actor={"batching": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 2, "ppo_epochs": 2}})
    cfg = load_recipe_config(load_config(cfg_path), 4)
    text = explain(cfg, 4)
    assert "8 prompts × n 4 = 32 samples" in text
    assert "2 mini-batch(es) of 4 prompts × 2 epoch(s) = 4 optimizer step(s)" in text
    assert "4 samples in 2 micro-batch(es) of ≤ 2 = 2 gradient-accumulation step(s)" in text
    params = _hf_params(tiny_model_dir)
    weights_gib = params * 4 / 4 / 2**30  # fp32, sharded over 4 ranks
    assert f"actor parameters {weights_gib:.2f} GiB" in text
    # shared prefix: a mini-batch's 4 prompts over 4 ranks = 1 prompt per rank (64 tokens), run once, then its
    # 4 samples in suffix micro-batches of 2 x (1 + 8) tokens
    assert ("memory traced: 1 prompt(s) of 64 tokens once, then suffix micro-batches of 2 × (1 + 8) tokens, "
            "forward + backward + optimizer step on fake tensors") in text
    assert text.count("rank ") >= 4 and "rank 3:" in text


def test_a_ranks_peak_is_what_it_holds_throughout_plus_its_largest_working_set():
    gib = 2**30
    items = {"actor parameters": 1 * gib, "actor optimizer states": 2 * gib, "actor activations": 3 * gib,
             "ref parameters": 1 * gib, "ref activations": gib // 2, "rollout weights": 2 * gib,
             "rollout KV cache": 2 * gib}
    phase_of = {"actor activations": "actor", "ref activations": "ref", "rollout weights": "rollout",
                "rollout KV cache": "rollout"}
    # held throughout: 1 + 2 + 1 = 4; working sets: actor 3, ref 0.5, rollout 4 -> 4 + 4 = 8 (the sum would be 11.5)
    assert _rank_peak(items, phase_of) == ("8.00 GiB, in the rollout's calls (held throughout 4.00 GiB; working "
                                           "sets: actor 3.00, ref 0.50, rollout 4.00 GiB)")
    assert _rank_peak(items, {}) == "11.50 GiB"  # nothing has a phase (async mode): everything adds up


def test_a_colocated_engine_is_memory_of_its_phase_and_a_split_one_is_held(tiny_model_dir, tmp_path):
    """K and V of 256 slots x 4096 tokens (fp32, every layer) dwarf the tiny model: colocated, the rank peaks in
    the rollout's calls at the engine's memory plus what the actor holds; placed apart, the engine's rank holds
    it throughout and the actor's rank peaks in the actor's calls."""
    engine = {"max_batch_size": 256, "max_seq_len": 4096}
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    kv = 2 * config.num_hidden_layers * 256 * 4096 * config.num_key_value_heads * (
        config.hidden_size // config.num_attention_heads) * 4
    colocated = explain(load_recipe_config(load_config(write_config(tmp_path / "a.yaml", tiny_model_dir,
                                                                    rollout={"engine": engine})), 1), 1)
    line = next(x for x in colocated.splitlines() if x.startswith("  rank 0: "))
    found = re.match(r"  rank 0: ([\d.]+) GiB, in the rollout's calls \(held throughout ([\d.]+) GiB; working sets: "
                     r"actor ([\d.]+), rollout ([\d.]+) GiB\)", line)
    assert found, line
    total, held, actor, rollout = map(float, found.groups())
    assert rollout >= round(kv / 2**30, 2) > actor  # the engine's working set is the larger one ...
    assert abs(total - (held + rollout)) <= 0.011  # ... and what the rank holds comes on top of it, not the actor's
    split = explain(load_recipe_config(load_config(write_config(
        tmp_path / "b.yaml", tiny_model_dir, rollout={"engine": engine}, placement={"actor": [0], "rollout": [1]})),
        2), 2)
    actor_line = next(x for x in split.splitlines() if x.startswith("  rank 0: "))
    assert "in the actor's calls" in actor_line and "rollout" not in actor_line, actor_line
    assert re.search(rf"  rank 1: [\d.]+ GiB  \(rollout weights [\d.]+ GiB, rollout KV cache {kv / 2**30:.2f} GiB\)",
                     split), split  # held throughout: no phase, the plain sum
    overlapping = explain(load_recipe_config(load_config(write_config(
        tmp_path / "c.yaml", tiny_model_dir, rollout={"engine": engine}, placement={"actor": [0], "rollout": [1]},
        trainer={"mode": "async"})), 2), 2)
    assert "memory per rank (estimate; in async mode every role's memory adds up):" in overlapping
    actor_line = next(x for x in overlapping.splitlines() if x.startswith("  rank 0: "))
    assert re.match(r"  rank 0: [\d.]+ GiB  \(actor parameters", actor_line), actor_line  # a plain sum, no phase


def _activations(text: str) -> float:
    return float(re.search(r"actor activations ([\d.]+) GiB", text).group(1))


def test_a_shared_prefix_trace_holds_a_mini_batchs_prompts_through_its_micro_batches(tiny_model_dir, tmp_path):
    # 8 prompts x 4, mini-batches of 8 prompts, micro-batches of 2 samples, one rank: the prompts' pass over 8
    # prompts of 64 tokens (504 tokens without their last) lives through every suffix micro-batch of 2 x (1 + 8)
    # tokens; a dense micro-batch holds 2 x (64 + 8) = 144 tokens. The old estimate (dense rows as many as those
    # tokens, capped at the micro-batch's 2) undercounted what the rank holds.
    batching = {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_device": 2}
    shared = explain(load_recipe_config(load_config(write_config(
        tmp_path / "a.yaml", tiny_model_dir, data={"train_batch_size": 8}, actor={"batching": batching})), 1), 1)
    assert ("memory traced: 8 prompt(s) of 64 tokens once, then suffix micro-batches of 2 × (1 + 8) tokens, "
            "forward + backward + optimizer step") in shared
    dense = explain(load_recipe_config(load_config(write_config(
        tmp_path / "b.yaml", tiny_model_dir, data={"train_batch_size": 8},
        actor={"batching": batching, "shared_prefix": False})), 1), 1)
    assert "memory traced: one micro-batch of 2 × (64 + 8) tokens, forward + backward + optimizer step" in dense
    assert _activations(shared) > 2 * _activations(dense)
    offloaded = explain(load_recipe_config(load_config(write_config(
        tmp_path / "c.yaml", tiny_model_dir, data={"train_batch_size": 8},
        actor={"batching": batching, "memory": {"offload_prefix_activations": True}})), 1), 1)
    assert re.search(r"\(the prompts' pass's activations offloaded: [\d.]+ GiB of host memory per rank\)", offloaded)
    assert _activations(offloaded) < _activations(shared)


def test_cli_dry_run_prints_without_torchrun_and_fails_like_a_run(tiny_model_dir, tmp_path):
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir,
                            placement={"actor": [0, 1], "rollout": [2, 3]},
                            actor={"batching": {"ppo_micro_batch_size_per_device": 4}})
    ok = subprocess.run([sys.executable, str(RECIPE), "--config", str(cfg_path), "--dry-run", "--world-size", "4"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "rollout   ranks 2,3" in ok.stdout and "on its own ranks" in ok.stdout
    bad = subprocess.run([sys.executable, str(RECIPE), "--config", str(cfg_path), "--dry-run", "--world-size", "4",
                          "actor.optim.lrr=1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "actor.optim.lrr: unknown key (did you mean 'lr'?)" in bad.stderr


@pytest.mark.parametrize("shared", [False, True])
def test_flops_per_step_worked_out_by_hand(tiny_model_dir, tmp_path, shared):
    # 4 prompts x 4 = 16 samples of 64 + 8 tokens at most, one rank, one mini-batch: no old log-prob pass, no ref.
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir, actor={"shared_prefix": shared})
    text = explain(load_recipe_config(load_config(cfg_path), 1), 1)
    model = TransformerFlops.from_model(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    b, p, r, prompts = 16, 64, 8, 4
    if shared:  # prompts but their last token once; then last prompt token + response, reading the prompt
        counts = (prompts * (p - 1) + b * (1 + r),
                  prompts * (p - 1) * p // 2 + b * sum(p - 1 + t for t in range(1, r + 2)), b * r)
    else:
        counts = (b * (p + r), b * (p + r) * (p + r + 1) // 2, b * r)
    # generation: each prompt prefilled once (last position scored), each sample feeds back r - 1 tokens
    rollout = (prompts * p + b * (r - 1), prompts * p * (p + 1) // 2 + b * sum(p + t for t in range(1, r)),
               prompts + b * (r - 1))
    assert (f"actor update {3 * model.forward(*counts) / 1e12:.3g} TFLOP, rollout "
            f"{model.forward(*rollout) / 1e12:.3g} TFLOP") in text


def test_dry_run_explains_an_agents_budgets(tiny_model_dir, tmp_path):
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir,
                            rollout={"max_tokens": 40, "engine": {"max_seq_len": 160},
                                     "agent": {"tools": ["calculator"], "max_turns": 3,
                                               "tool_calls": {"format": "tags", "tags": {"calc": "calculator"}}}})
    ok = subprocess.run([sys.executable, str(RECIPE), "--config", str(cfg_path), "--dry-run"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ("agent: tools ['calculator']; ≤ 3 model turns, ≤ 40 model tokens over all turns, observations ≤ 256 "
            "tokens each, whole trajectory ≤ 160 tokens (rollout.engine.max_seq_len); reward: reward_fn") in ok.stdout


def test_dry_run_lists_the_distillation_teachers_memory_and_flops(tiny_model_dir, tmp_path):
    """A wider teacher than the student: its own parameter count and forward FLOPs (dense layout, the same
    samples as the old log-prob pass, which distillation needs even with one optimizer step per rollout)."""
    from torchrlhf.models import save_tiny_model

    teacher = str(save_tiny_model(tmp_path / "teacher", hidden_size=128, intermediate_size=192, head_dim=32))
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir, actor={"shared_prefix": False},
                            teacher={"model_path": teacher}, algorithm={"distill": {"coef": 0.5}})
    text = explain(load_recipe_config(load_config(cfg_path), 1), 1)
    params = _hf_params(teacher)
    # one rank holds each model as the workers do (`model_layout`): no FSDP2 there
    assert f"  teacher   ranks 0: one rank, the plain module (no FSDP2), {params / 1e6:.1f} M parameters" in text
    assert "  actor     ranks 0: one rank, the plain module (no FSDP2)" in text
    bf16 = explain(load_recipe_config(load_config(cfg_path, ["+actor.dtype=bfloat16"]), 1), 1)
    assert "  actor     ranks 0: one rank, float32 weights and bfloat16 compute copies (no FSDP2)" in bf16
    assert "distillation: A = 1 × A_task + 0.5 × (log p_teacher − log p_student) per sampled token" in text
    assert f"teacher parameters {params * 4 / 2**30:.2f} GiB" in text
    b, p, r = 16, 64, 8
    counts = (b * (p + r), b * (p + r) * (p + r + 1) // 2, b * r)
    student = TransformerFlops.from_model(transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    wide = TransformerFlops.from_model(transformers.AutoModelForCausalLM.from_pretrained(teacher))
    assert (f"old log-probs {student.forward(*counts) / 1e12:.3g} TFLOP, teacher {wide.forward(*counts) / 1e12:.3g} "
            "TFLOP") in text


def test_dry_run_names_an_agent_harness():
    ok = subprocess.run([sys.executable, str(RECIPE), "--config", "recipes/configs/grpo_calculator_harness_cpu.yaml",
                         "--dry-run"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ("agent: harness recipes/harness/calculator_agent.py:run_agent (an OpenAI-compatible endpoint on "
            "127.0.0.1), ≤ 48 model tokens over all calls, ≤ 300s per trajectory; reward: env") in ok.stdout


def test_dry_run_lists_the_judge_memory_per_rank(tiny_model_dir, tmp_path):
    # one whole judge engine on rank 1: fp32 weights + K and V of 256 slots x 4096 tokens for every layer
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir, placement={"judge": [1]},
                            actor={"batching": {"ppo_micro_batch_size_per_device": 8}},
                            judge={"model_path": tiny_model_dir, "sampling": {"max_tokens": 4}, "batch_size": 2,
                                   "engine": {"max_batch_size": 256, "max_seq_len": 4096}})
    text = explain(load_recipe_config(load_config(cfg_path), 2), 2)
    assert "  actor     ranks 0,1: FSDP2 over 2 × TP 1 (mesh dp_shard=2, tp=1)" in text
    config = transformers.AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    kv = 2 * config.num_hidden_layers * 256 * 4096 * config.num_key_value_heads * head_dim * 4
    assert kv > 2**28  # large enough to show in GiB with two decimals
    params = _hf_params(tiny_model_dir)
    assert (f"judge     ranks 1: {params / 1e6:.1f} M parameters, KV cache 256 slots × 4096 tokens = "
            f"{kv / 2**30:.2f} GiB per rank; verdicts ≤ 4 tokens, 2 per engine call") in text
    assert f"judge weights {params * 4 / 2**30:.2f} GiB, judge KV cache {kv / 2**30:.2f} GiB)" in text
    assert "judge.sleep" not in text
    sleeping = load_recipe_config(load_config(cfg_path, ["+judge.sleep=true"]), 2)
    assert "2 per engine call; held only while judging (judge.sleep)" in explain(sleeping, 2)
    # TP 2 over ranks 1 and 2 (world size 3): each rank holds half of the weights and of the KV cache
    tp = explain(load_recipe_config(load_config(cfg_path, ["+placement.actor=[0]", "placement.judge=[1,2]", "+judge.tp_size=2"]), 3), 3)
    assert (f"judge     ranks 1,2: {params / 1e6:.1f} M parameters, 1 engine(s) of TP 2, KV cache 256 slots × 4096 "
            f"tokens = {kv / 2 / 2**30:.2f} GiB per rank") in tp
    assert f"judge weights {params * 2 / 2**30:.2f} GiB, judge KV cache {kv / 2 / 2**30:.2f} GiB)" in tp
    with pytest.raises(ConfigError, match=r"judge.tp_size=2 must divide the judge's 1 ranks \(placement.judge\)"):
        load_recipe_config(load_config(cfg_path, ["+judge.tp_size=2"]), 2)
