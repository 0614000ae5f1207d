"""tools/merge_checkpoint.py on a LoRA actor's checkpoint: a merged HF directory and a PEFT adapter directory,
both giving the trained actor's logits (PEFT loads the adapter itself: `PeftModel.from_pretrained`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from torchrlhf.models import save_tiny_model
from torchrlhf.workers import ActorWorker, Batching

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "workers"))
from dist_helpers import rollout_batch  # noqa: E402


def _merge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "merge_checkpoint.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA actor (q/v/down projections, tied embeddings) after two updates, and its checkpoint."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora_export")
    base = save_tiny_model(root / "base", tokenizer_from=None, vocab_size=128, tie_word_embeddings=True)
    actor = ActorWorker(str(base), optim={"lr": 5e-2}, batching=Batching(ppo_mini_batch_size=4),
                        lora={"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"]})
    for seed in (0, 1):
        actor.update(rollout_batch(4, seed=seed), temperature=1.0)
    actor.save_checkpoint(str(root / "ckpt"))
    return base, root, actor


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_merged_and_peft_round_trip(trained):
    base, root, actor = trained
    proc = _merge("--checkpoint", str(root / "ckpt"), "--base", str(base), "--out", str(root / "merged"),
                  "--adapter-out", str(root / "adapter"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    want = _logits(actor.model, ids)
    assert (want - _logits(AutoModelForCausalLM.from_pretrained(base), ids)).abs().max() > 1e-2  # it trained

    merged = AutoModelForCausalLM.from_pretrained(root / "merged")
    torch.testing.assert_close(_logits(merged, ids), want, atol=1e-5, rtol=1e-5)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # ties kept

    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), root / "adapter")
    torch.testing.assert_close(_logits(peft, ids), want, atol=1e-5, rtol=1e-5)
    wrapped = {n for n, m in peft.named_modules() if hasattr(m, "lora_A") and not n.endswith("lora_A")}
    assert len(wrapped) == 3 * 2 and all(n.endswith(("q_proj", "v_proj", "down_proj")) for n in wrapped)


def test_adapter_only_export_and_bad_requests(trained, tmp_path):
    base, root, _ = trained
    proc = _merge("--checkpoint", str(root / "ckpt"), "--base", str(base), "--adapter-out", str(tmp_path / "a"))
    assert proc.returncode == 0 and sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"], proc.stderr[-3000:]
    proc = _merge("--checkpoint", str(root / "ckpt"), "--base", str(base))
    assert proc.returncode != 0 and "give --out (merged HF model) and/or --adapter-out" in proc.stderr

    full = ActorWorker(str(base), batching=Batching(ppo_mini_batch_size=4))
    full.save_checkpoint(str(tmp_path / "full"))
    proc = _merge("--checkpoint", str(tmp_path / "full"), "--base", str(base), "--adapter-out", str(tmp_path / "b"))
    assert proc.returncode != 0 and "no --adapter-out: it has no adapters" in proc.stderr
