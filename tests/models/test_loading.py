import json
import os

import pytest
import torch
from safetensors.torch import load_file

from tests.models.conftest import needs_smollm2
from torchrlhf.models import (
    build_tiny_causal_lm,
    load_causal_lm,
    load_tokenizer,
    save_tiny_model,
    smollm2_gguf_path,
    smollm2_model_dir,
)


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_causal_lm(missing)
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_tokenizer(missing)


def test_tiny_model_is_small_gqa_and_seeded():
    a = build_tiny_causal_lm(vocab_size=256, seed=3)
    b = build_tiny_causal_lm({"vocab_size": 256}, seed=3)
    c = build_tiny_causal_lm(vocab_size=256, seed=4)
    cfg = a.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (4, 2, 2)
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert torch.equal(a.model.layers[0].self_attn.q_proj.weight, b.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.weight, c.model.layers[0].self_attn.q_proj.weight)
    untied = build_tiny_causal_lm(vocab_size=256, tie_word_embeddings=False)
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight


def test_load_from_dir_matches_saved_weights(tiny_dir):
    model = load_causal_lm(tiny_dir)
    saved = load_file(os.path.join(tiny_dir, "model.safetensors"))
    for name, p in model.state_dict().items():
        if name in saved:
            assert torch.equal(p, saved[name]), name
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied survives the round trip
    # The in-memory model built from the same seed, without any save/load in between.
    ref = build_tiny_causal_lm(vocab_size=256, seed=0)
    ids = torch.randint(0, 256, (2, 7))
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)
    assert load_causal_lm(tiny_dir, dtype=torch.bfloat16).dtype == torch.bfloat16


@needs_smollm2
class TestSmolLM2:
    @pytest.fixture(scope="class")
    def gguf_model(self):
        return load_causal_lm(smollm2_gguf_path())

    @pytest.fixture(scope="class")
    def converted(self, tmp_path_factory, gguf_model):
        # The conversion's own GGUF load is the one the `gguf_model` fixture already did (it takes
        # ~20 s on a shared CPU); everything else (saving, tokenizer, atomic rename) runs for real.
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("torchrlhf.models.loading.load_causal_lm", lambda *a, **k: gguf_model)
            return smollm2_model_dir(tmp_path_factory.mktemp("cache") / "smollm2")

    def test_gguf_path(self):
        p = smollm2_gguf_path()
        assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.is_file()

    def test_gguf_loads_dequantized_with_known_shape(self, gguf_model):
        cfg = gguf_model.config
        assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == ("llama", 576, 30, 49152)
        assert getattr(gguf_model, "hf_quantizer", None) is None
        assert not hasattr(cfg, "quantization_config")
        assert all(p.dtype == torch.float32 for p in gguf_model.parameters())
        n_params = sum(p.numel() for p in gguf_model.parameters())
        assert 134e6 < n_params < 136e6

    def test_dequantized_weights_match_gguf_package(self, gguf_model):
        # Independent reference: the gguf package's own dequantizer on the raw Q4_1 blocks.
        from gguf import GGUFReader
        from gguf.quants import dequantize

        tensors = {t.name: t for t in GGUFReader(str(smollm2_gguf_path())).tensors}
        for gguf_name, param in [
            ("blk.0.ffn_down.weight", gguf_model.model.layers[0].mlp.down_proj.weight),
            ("blk.29.ffn_up.weight", gguf_model.model.layers[29].mlp.up_proj.weight),
            ("token_embd.weight", gguf_model.model.embed_tokens.weight),
        ]:
            t = tensors[gguf_name]
            expected = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
            torch.testing.assert_close(param.detach(), expected, rtol=0, atol=0)

    def test_tokenizer_and_greedy_answer(self, converted, gguf_model):
        tok = load_tokenizer(converted)
        assert tok.pad_token is not None and tok.chat_template
        x = tok("The capital of France is", return_tensors="pt")
        with torch.no_grad():
            nxt = gguf_model(**x).logits[0, -1].argmax()
        assert tok.decode(nxt).strip() == "Paris"

    def test_gguf_model_trains(self, gguf_model):
        model = gguf_model
        snapshot = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = torch.randint(0, 49152, (1, 8), generator=torch.Generator().manual_seed(0))
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(p.grad is not None for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert not torch.equal(snapshot["model.layers.0.mlp.down_proj.weight"], model.model.layers[0].mlp.down_proj.weight)
        with torch.no_grad():
            after = model(input_ids=ids, labels=ids).loss
            assert after < loss  # one SGD step on the same batch lowers its loss
            for n, p in model.named_parameters():  # restore: the class fixture is shared with other tests
                p.copy_(snapshot[n])

    def test_converted_cache_matches_gguf(self, converted, gguf_model):
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(
            os.listdir(converted)
        )
        assert "quantization_config" not in json.loads((converted / "config.json").read_text())
        assert not [p for p in converted.parent.iterdir() if ".tmp-" in p.name]  # no leftovers
        reloaded = load_causal_lm(converted)
        ids = torch.randint(0, 49152, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=ids).logits, gguf_model(input_ids=ids).logits, rtol=0, atol=0)
        assert smollm2_model_dir(converted) == converted  # second call: cache hit

    def test_half_written_cache_is_redone(self, converted, tmp_path, monkeypatch):
        # A cache dir without weights (a conversion killed by hand) is not mistaken for a finished one.
        broken = tmp_path / "smollm2"
        broken.mkdir()
        (broken / "config.json").write_text("{}")
        monkeypatch.setattr("torchrlhf.models.loading.load_causal_lm", lambda *a, **k: load_causal_lm(converted))
        monkeypatch.setattr("torchrlhf.models.loading.load_tokenizer", lambda *a: load_tokenizer(converted))
        out = smollm2_model_dir(broken)
        assert (out / "model.safetensors").is_file()

    def test_save_tiny_model_with_smollm2_tokenizer(self, tmp_path):
        d = save_tiny_model(tmp_path / "tiny", seed=1)
        tok = load_tokenizer(d)
        model = load_causal_lm(d)
        assert model.config.vocab_size == len(tok) == 49152
        assert tok.chat_template


def test_loading_hides_the_per_tensor_bar_and_restores_the_setting(tmp_path, capfd):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = save_tiny_model(tmp_path, tokenizer_from=None, vocab_size=64)
    capfd.readouterr()
    AutoModelForCausalLM.from_pretrained(str(path))
    assert "Loading weights" in capfd.readouterr().err  # transformers' own bar, which a run would show per model
    load_causal_lm(path)
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting is back
