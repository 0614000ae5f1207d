import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from torchrlhf.models import load_causal_lm, load_value_model
from torchrlhf.utils.checkpoint import save_checkpoint

_spec = importlib.util.spec_from_file_location(
    "merge_checkpoint", Path(__file__).resolve().parents[2] / "tools" / "merge_checkpoint.py"
)
merge_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(merge_tool)


def _train_one_step(model, ids):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = model(input_ids=ids).logits if hasattr(model, "lm_head") else model(ids)
    out.float().pow(2).mean().backward()
    opt.step()
    return opt


def test_causal_lm_round_trip(tiny_dir, tmp_path):
    model = load_causal_lm(tiny_dir)
    ids = torch.randint(0, 256, (2, 7))
    opt = _train_one_step(model, ids)  # weights now differ from the base dir
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    out = merge_tool.merge_checkpoint(tmp_path / "ckpt", tiny_dir, tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert not list(tmp_path.glob(".hf.tmp*"))


def test_value_model_round_trip(tiny_dir, tmp_path):
    model = load_value_model(tiny_dir, init_head_std=0.1)
    ids = torch.randint(0, 256, (2, 7))
    _train_one_step(model, ids)
    save_checkpoint(tmp_path / "ckpt", model=model)
    out = merge_tool.merge_checkpoint(tmp_path / "ckpt", tiny_dir, tmp_path / "hf", head="value")
    merged = AutoModelForTokenClassification.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits.squeeze(-1), model(ids))
    ours = model.state_dict()
    for name, tensor in merged.state_dict().items():  # every exported weight is the trained one, bit for bit
        torch.testing.assert_close(tensor, ours[name], rtol=0, atol=0, msg=name)
    reloaded = load_value_model(out)  # and our own loader picks the trained head back up
    torch.testing.assert_close(reloaded.score.weight, model.score.weight, rtol=0, atol=0)


def test_bf16_export(tiny_dir, tmp_path):
    model = load_causal_lm(tiny_dir)
    save_checkpoint(tmp_path / "ckpt", model=model)
    out = merge_tool.merge_checkpoint(tmp_path / "ckpt", tiny_dir, tmp_path / "hf", dtype=torch.bfloat16)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert merged.dtype == torch.bfloat16
    torch.testing.assert_close(merged.model.embed_tokens.weight, model.model.embed_tokens.weight.bfloat16())


def test_clear_errors(tiny_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a DCP checkpoint"):
        merge_tool.merge_checkpoint(tmp_path, tiny_dir, tmp_path / "hf")
    save_checkpoint(tmp_path / "ckpt", model=load_causal_lm(tiny_dir))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        merge_tool.merge_checkpoint(tmp_path / "ckpt", tmp_path, tmp_path / "hf")
    with pytest.raises(KeyError, match="prefix 'actor.'"):
        merge_tool.merge_checkpoint(tmp_path / "ckpt", tiny_dir, tmp_path / "hf", prefix="actor.")


def test_a_moe_round_trip_writes_the_per_expert_hf_layout(tmp_path):
    """A Qwen3-MoE checkpoint (experts stacked, as trained) exports as HF writes MoE checkpoints, one tensor per
    expert and projection, and loads back to the same logits."""
    from safetensors import safe_open

    from torchrlhf.models import save_tiny_model

    base = save_tiny_model(tmp_path / "base", family="qwen3_moe", vocab_size=256, tokenizer_from=None)
    model = load_causal_lm(base)
    ids = torch.randint(0, 256, (2, 7))
    opt = _train_one_step(model, ids)
    save_checkpoint(tmp_path / "ckpt", model=model, optimizer=opt)
    out = merge_tool.merge_checkpoint(tmp_path / "ckpt", base, tmp_path / "hf")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys and not any(k.endswith("gate_up_proj") for k in keys)
    merged = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
