"""oneDNN-prepacked CPU projections: same products as F.linear, never stale, no duplicate weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams
from torchrlhf.generation.prepacked import PackedLinear, PrepackedLinears

from gen_helpers import hf_greedy, left_padded, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts() -> Batch:
    ids, mask = left_padded([5, 9, 3, 7], seed=2)
    return Batch({"input_ids": ids, "attention_mask": mask})


@pytest.mark.parametrize("shape", [(1, 48), (7, 48), (3, 5, 48)])
def test_prepacked_linear_matches_f_linear(shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 80), nn.Linear(80, 80, bias=False))
    linear, plain = model[0].weight, model[1].weight
    expected = {name: p.detach().clone() for name, p in model.named_parameters()}
    packs = PrepackedLinears(model)
    assert [type(m) for m in model] == [PackedLinear, PackedLinear]
    assert model[0].weight is linear and model[1].weight is plain  # the same Parameters, under the same names
    assert set(dict(model.named_parameters())) == set(expected)
    assert packs.refresh() == 2 and packs.refresh() == 0  # packed once, until a weight changes
    x = torch.randn(shape)
    with torch.no_grad():
        h = F.linear(x, expected["0.weight"], expected["0.bias"])
        torch.testing.assert_close(model[0](x), h, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(x), F.linear(h, expected["1.weight"]), rtol=1e-5, atol=1e-5)


def test_an_invalidated_module_computes_with_its_current_weight():
    model = nn.Sequential(nn.Linear(8, 4))
    packs = PrepackedLinears(model)
    packs.refresh()
    x = torch.randn(2, 8)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
        packs.invalidate(model[0].weight)
        assert model[0].packed is None
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias))
        assert packs.refresh() == 1
        torch.testing.assert_close(model(x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_engine_agrees_with_the_unpacked_one(family, tmp_path):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    packed = NativeEngine(tmp_path, max_batch_size=2, max_seq_len=64)
    unpacked = NativeEngine(tmp_path, max_batch_size=2, max_seq_len=64, cpu_prepack=False)
    assert packed.prepacked is not None and unpacked.prepacked is None
    a, b = packed.generate(prompts(), GREEDY), unpacked.generate(prompts(), GREEDY)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["responses"], hf_greedy(model, prompts(), 10))
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="the CPU has no bf16 instructions")
def test_bf16_engine_is_packed_where_the_cpu_has_bf16_and_agrees(tmp_path):
    """bf16 packing (AVX512-BF16 / AMX): transformers' own bf16 greedy tokens, the unpacked engine's log-probs."""
    model = tiny_model().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    packed = NativeEngine(tmp_path, max_batch_size=2, max_seq_len=64, dtype=torch.bfloat16)
    unpacked = NativeEngine(tmp_path, max_batch_size=2, max_seq_len=64, dtype=torch.bfloat16, cpu_prepack=False)
    assert packed.prepacked is not None and unpacked.prepacked is None
    a, b = packed.generate(prompts(), GREEDY), unpacked.generate(prompts(), GREEDY)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["responses"], hf_greedy(model, prompts(), 10))
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], rtol=0, atol=2e-2)


def test_a_shared_model_is_not_packed_and_its_changes_reach_generation():
    """Writes to a model passed in can come from anywhere (optimizer, load_state_dict, ``.data``): no packed copy."""
    model = tiny_model(seed=0)
    engine = NativeEngine(model, max_batch_size=4, max_seq_len=64)
    assert engine.prepacked is None
    before = engine.generate(prompts(), GREEDY)["responses"]
    assert torch.equal(before, hf_greedy(model, prompts(), 10))

    opt = torch.optim.SGD(model.parameters(), lr=5.0)
    logits = model(input_ids=prompts()["input_ids"]).logits
    (-logits[..., 7].mean()).backward()  # push every position towards token 7
    opt.step()
    stepped = engine.generate(prompts(), GREEDY)["responses"]
    assert not torch.equal(stepped, before)
    assert torch.equal(stepped, hf_greedy(model, prompts(), 10))

    with torch.no_grad():
        for p, q in zip(model.parameters(), tiny_model(seed=1).parameters()):
            p.data.copy_(q)  # no version-counter bump: only an unpacked engine can see this
    assert torch.equal(engine.generate(prompts(), GREEDY)["responses"], hf_greedy(model, prompts(), 10))


def test_owned_weights_are_packed_instead_of_copied(tmp_path):
    model_a, model_b = tiny_model(seed=0), tiny_model(seed=1)
    model_a.save_pretrained(tmp_path)
    engine = NativeEngine(tmp_path, max_batch_size=4, max_seq_len=64)
    assert torch.equal(engine.generate(prompts(), GREEDY)["responses"], hf_greedy(model_a, prompts(), 10))
    layer = engine.model.model.layers[0]
    for proj in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert proj.weight.untyped_storage().nbytes() == 0  # only the packed copy is kept
    assert engine.model.model.embed_tokens.weight.untyped_storage().nbytes() > 0  # the tied lm_head reads it

    # Without release/resume. First only the embedding: the tied lm_head's packed copy must follow it.
    with torch.no_grad():
        model_a.model.embed_tokens.weight.copy_(model_b.model.embed_tokens.weight)
    engine.update_weights([("model.embed_tokens.weight", model_b.model.embed_tokens.weight.detach())])
    assert torch.equal(engine.generate(prompts(), GREEDY)["responses"], hf_greedy(model_a, prompts(), 10))
    # Then everything: update_weights writes into the freed projections and generation repacks them.
    engine.update_weights((name, p.detach()) for name, p in model_b.named_parameters())
    assert torch.equal(engine.generate(prompts(), GREEDY)["responses"], hf_greedy(model_b, prompts(), 10))


def test_a_compiled_engine_fuses_around_the_packed_products_and_new_weights_need_no_recompile(tmp_path):
    """``compile=True`` keeps the packed products (an opaque op in the compiled step; the plain weights are
    freed, so an unpacked product could not give transformers' tokens), and `update_weights` repacks without
    recompiling: the op reads the packed weight at run time."""
    model_a, model_b = tiny_model(seed=0), tiny_model(seed=1)
    model_a.save_pretrained(tmp_path)
    engine = NativeEngine(tmp_path, max_batch_size=4, max_seq_len=64, compile=True)
    assert engine.prepacked is not None
    assert torch.equal(engine.generate(prompts(), GREEDY)["responses"], hf_greedy(model_a, prompts(), 10))
    assert engine.model.model.layers[0].mlp.up_proj.weight.untyped_storage().nbytes() == 0
    engine.update_weights((name, p.detach()) for name, p in model_b.named_parameters())
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = engine.generate(prompts(), GREEDY)
    assert torch.equal(out["responses"], hf_greedy(model_b, prompts(), 10))
