import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from torchrlhf.models import (
    TP_SUPPORTED_MODEL_TYPES,
    build_tiny_causal_lm,
    check_tp_compatible,
    enable_activation_checkpointing,
    load_causal_lm,
    save_tiny_model,
)
from torchrlhf.models.parallelize import model_layout

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_dist_parallel.py")


def test_tp_plan_rejects_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"'gpt2'.*supported model types: llama, qwen2, qwen3, mistral"):
        check_tp_compatible(gpt2, 2)
    assert set(TP_SUPPORTED_MODEL_TYPES) == {"llama", "qwen2", "qwen3", "mistral"}


def test_tp_plan_rejects_indivisible_heads():
    with torch.device("meta"):
        model = build_tiny_causal_lm(vocab_size=64)  # 4 heads, 2 kv heads
    check_tp_compatible(model, 2)
    with pytest.raises(ValueError, match="tp=4 must divide num_attention_heads=4 and num_key_value_heads=2"):
        check_tp_compatible(model, 4)


@pytest.mark.parametrize("value_model", [False, True])
def test_activation_checkpointing_recomputes_with_same_grads(tiny_dir, value_model):
    from torchrlhf.models import load_value_model

    ids = torch.randint(0, 256, (2, 6))
    grads, calls = [], []
    for ac in (False, True):
        model = load_value_model(tiny_dir) if value_model else load_causal_lm(tiny_dir)
        if ac:
            enable_activation_checkpointing(model)
        model.train()
        n = [0]
        model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: n.__setitem__(0, n[0] + 1))
        out = model(ids) if value_model else model(input_ids=ids).logits
        out.float().pow(2).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        calls.append(n[0])
    assert calls == [1, 2]  # checkpointing re-runs the block's forward in backward
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def _run(nproc: int, tp: int, workdir: Path) -> None:
    save_tiny_model(workdir / "tied", vocab_size=256, seed=0, tokenizer_from=None)
    save_tiny_model(workdir / "untied", vocab_size=256, seed=1, tie_word_embeddings=False, tokenizer_from=None)
    if tp > 1:  # the other TP families: Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms)
        from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

        dims = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
        for name, config_cls, model_cls in [("qwen2", Qwen2Config, Qwen2ForCausalLM),
                                            ("qwen3", Qwen3Config, Qwen3ForCausalLM)]:
            torch.manual_seed(0)
            model = model_cls(config_cls(**dims))
            if name == "qwen2":
                with torch.no_grad():  # HF zero-inits biases: make them count
                    for block in model.model.layers:
                        block.self_attn.q_proj.bias.normal_()
                        block.self_attn.k_proj.bias.normal_()
            model.save_pretrained(workdir / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(SCRIPT), str(tp), str(workdir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert sorted(re.findall(r"OK (\d+)", proc.stdout)) == [str(r) for r in range(nproc)]


def _check_merged(workdir: Path, tmp_path: Path) -> None:
    """The DCP saved by the sharded run (after one SGD step) exports to HF with the trained weights."""
    out = tmp_path / "merged"
    subprocess.run([sys.executable, str(REPO / "tools" / "merge_checkpoint.py"), "--checkpoint", str(workdir / "ckpt"),
                    "--base", str(workdir / "tied"), "--out", str(out)], check=True, timeout=120,
                   capture_output=True)
    merged = load_causal_lm(out)
    # Reference: the same single SGD step taken on one process (see _dist_parallel.check_causal_lm).
    ref = load_causal_lm(workdir / "tied")
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 256, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1)).backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=2e-5)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight


def test_fsdp_two_ranks(tmp_path):
    _run(2, 1, tmp_path / "w")
    _check_merged(tmp_path / "w", tmp_path)


def test_fsdp_x_tp_four_ranks(tmp_path):
    _run(4, 2, tmp_path / "w")
    _check_merged(tmp_path / "w", tmp_path)


@pytest.mark.parametrize("ranks, dtype, trainable, lora, want", [
    (1, torch.float32, True, False, "plain"), (1, torch.bfloat16, False, False, "plain"),
    (1, torch.bfloat16, True, False, "copies"), (1, torch.bfloat16, True, True, "fsdp"),
    (1, torch.float32, True, True, "plain"), (2, torch.float32, True, False, "fsdp"),
    (2, torch.bfloat16, False, False, "fsdp")])
def test_model_layout_is_fsdp2_wherever_there_is_more_than_one_rank_or_an_offload(ranks, dtype, trainable, lora, want):
    assert model_layout(ranks, dtype, trainable=trainable, lora=lora) == want
    assert model_layout(ranks, dtype, trainable=trainable, lora=lora, cpu_offload=True) == "fsdp"
