"""Qwen3-MoE in the one model definition, checked against transformers' own: logits and parameter gradients of
the model with our router, the load-balancing loss against ``load_balancing_loss_func``, the stacked experts read
from a per-expert checkpoint, and active-parameter FLOPs counted by hand."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from torchrlhf.models import load_causal_lm, save_tiny_model
from torchrlhf.models.lora import target_module_names
from torchrlhf.models.moe import (
    TopKRouter,
    active_expert_params,
    expert_load,
    load_balancing_loss,
    record_routing,
)
from torchrlhf.models.sharded import SafetensorsReader, build_meta_causal_lm, load_weights
from torchrlhf.utils.flops import TransformerFlops

VOCAB = 256


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Untied: `load_weights` is used after FSDP2 sharding, which keeps a tied head tied; a bare `to_empty` does
    not, and the head is not what this file tests."""
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_moe"), family="qwen3_moe", vocab_size=VOCAB,
                               num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=False,
                               tokenizer_from=None))


def _batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (3, 9), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding, as prompts come
    mask[2, :2] = 0
    return ids, mask


def test_logits_and_gradients_equal_transformers(moe_dir):
    ours = load_causal_lm(moe_dir)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32, attn_implementation="eager")
    routers = [m for m in ours.modules() if isinstance(m, TopKRouter)]
    assert len(routers) == 3 and not any(isinstance(m, TopKRouter) for m in hf.modules())
    ids, mask = _batch()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    weight = torch.randn(3, 9, VOCAB, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, model in (("ours", ours), ("hf", hf)):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        ((logits * weight)[mask.bool()]).sum().backward()
        out[name] = (logits, {n: p.grad for n, p in model.named_parameters()})
    real = mask.bool()
    torch.testing.assert_close(out["ours"][0][real], out["hf"][0][real], atol=1e-5, rtol=1e-5)
    assert out["ours"][1].keys() == out["hf"][1].keys()
    for n, g in out["hf"][1].items():
        assert g is not None and g.abs().sum() > 0, n
        # float32 sums of many terms in another order (SDPA against eager): roundoff reaches ~1.4e-6 of the
        # gradient's own scale on some CPUs' kernels; a wrong formula is off by orders of magnitude more
        scale = float(g.abs().max())
        torch.testing.assert_close(out["ours"][1][n], g, atol=1e-5 * scale, rtol=1e-4, msg=n)


def test_aux_loss_equals_transformers_with_and_without_padding(moe_dir):
    model = load_causal_lm(moe_dir)
    cfg = model.config
    ids, mask = _batch()
    with record_routing(model) as record:
        model(input_ids=ids, attention_mask=mask)
    assert len(record.logits) == 3 and record.experts[0].shape == (ids.numel(), 2)
    for m in (None, mask):
        ref = load_balancing_loss_func(tuple(record.logits), cfg.num_experts, cfg.num_experts_per_tok, m)
        ours = load_balancing_loss(record, cfg.num_experts, None if m is None else m.reshape(-1))
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
    # a sequence shared by two samples counts twice: the same as the batch that repeats it
    with record_routing(model) as twice:
        model(input_ids=torch.cat([ids[:1], ids]), attention_mask=torch.cat([mask[:1], mask]))
    weights = mask.reshape(-1).clone().float()
    weights[: ids.shape[1]] *= 2
    torch.testing.assert_close(load_balancing_loss(record, cfg.num_experts, weights),
                               load_balancing_loss(twice, cfg.num_experts, torch.cat([mask[:1], mask]).reshape(-1)))
    # expert load: every token-layer makes top_k choices
    assert expert_load(record, cfg.num_experts).sum() == 3 * ids.numel() * 2
    # the aux loss's gradient reaches the routers
    loss = load_balancing_loss(record, cfg.num_experts, mask.reshape(-1))
    loss.backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0
               for r in model.modules() if isinstance(r, TopKRouter))


def test_the_sharded_loader_stacks_per_expert_checkpoint_tensors(moe_dir, tmp_path):
    saved = load_file(f"{moe_dir}/model.safetensors")
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in saved  # HF writes one tensor per expert
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    model = build_meta_causal_lm(moe_dir)
    load_weights(model, moe_dir)
    hf_params = dict(hf.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, hf_params[name]), name
    reader = SafetensorsReader(moe_dir)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert reader.shape(name) == (8, 64, 64)
    assert torch.equal(reader.get_rows(name, 2, 5), hf_params[name][2:5])
    reader.close()
    # a checkpoint that lost an expert is named, not loaded short
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file({k: v for k, v in saved.items() if ".experts.3." not in k or "layers.2" not in k},
              str(broken / "model.safetensors"))
    (broken / "config.json").write_text(json.dumps(json.load(open(f"{moe_dir}/config.json"))))
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts.*found \[0, 1, 2, 4, 5, 6, 7\]"):
        SafetensorsReader(broken)


def test_flops_count_the_active_experts(moe_dir):
    model = load_causal_lm(moe_dir)
    cfg = model.config
    h, inter, e, k, layers = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok, 3
    attention = (cfg.num_attention_heads * cfg.head_dim * h * 2 + cfg.num_key_value_heads * cfg.head_dim * h * 2)
    active = e * h + k * 3 * inter * h  # router + top-k experts (gate, up, down)
    assert active_expert_params(model) == layers * active
    assert TransformerFlops.from_model(model).block_params == layers * (attention + active)
    total_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert total_experts == layers * e * 3 * inter * h  # all experts are held, a quarter of them run


def test_lora_all_linear_on_a_moe_targets_the_attention_projections(moe_dir):
    """The experts are 3-D parameters, not Linear modules: LoRA adapts attention and leaves them frozen."""
    names = target_module_names(build_meta_causal_lm(moe_dir), "all-linear")
    assert names and all(".self_attn." in n for n in names)
    assert {n.rsplit(".", 1)[-1] for n in names} == {"q_proj", "k_proj", "v_proj", "o_proj"}


def test_the_dry_runs_memory_trace_runs_the_experts(moe_dir):
    """Fake tensors cannot run the grouped GEMM (bf16-only meta kernel; a fallback loop over row counts): the trace
    runs a stand-in that allocates what it does, a gradient for every expert weight among them."""
    from torchrlhf.trainer.memory import trace_micro_batch

    traced = trace_micro_batch(moe_dir, dtype=torch.float32, micro=2, prompt_len=8, response_len=4)
    model = build_meta_causal_lm(moe_dir)
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    assert traced["gradients"] >= experts and traced["optimizer states"] >= 2 * experts


def test_a_checkpoint_with_another_expert_count_than_its_config_is_named(tmp_path):
    d = save_tiny_model(tmp_path / "four", family="qwen3_moe", vocab_size=VOCAB, num_experts=4, tokenizer_from=None,
                        tie_word_embeddings=False)
    config = json.loads((d / "config.json").read_text())
    config["num_local_experts"] = 8  # transformers' key for num_experts
    (d / "config.json").write_text(json.dumps(config))
    model = build_meta_causal_lm(d)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.gate_up_proj has shape \(4, 64, 64\), model "
                                         r"expects \(8, 64, 64\) \(a mixture-of-experts checkpoint"):
        load_weights(model, d)


def test_a_value_model_on_a_moe_backbone_runs_the_same_blocks(moe_dir):
    """Critic and reward models: the backbone's routers are ours too, and its values are transformers' backbone
    through the score head."""
    from torchrlhf.models import load_value_model

    critic = load_value_model(moe_dir, init_head_std=0.1)
    assert sum(isinstance(m, TopKRouter) for m in critic.modules()) == 3
    ids, mask = _batch()
    backbone = transformers.AutoModel.from_pretrained(moe_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        hidden = backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        want = critic.score(hidden).squeeze(-1)
        got = critic(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
