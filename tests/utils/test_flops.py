"""Model FLOP counts (`torchrlhf.utils.flops`) against independent counts; the MFU metrics of the workers."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from torchrlhf.models import build_tiny_causal_lm, save_tiny_model
from torchrlhf.models.packed_attention import PackedLayout
from torchrlhf.utils import flops
from torchrlhf.utils.flops import TRAIN_FORWARDS, TransformerFlops, causal_keys, generation_counts
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, forward_counts

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from dist_helpers import rollout_batch  # noqa: E402


@pytest.mark.parametrize("tied", [True, False])
def test_training_count_equals_flop_counter_mode_on_a_llama(tied):
    """Forward + backward of a tiny Llama through HF's eager attention, which forms every query's scores
    against all T keys with batched matmuls: `FlopCounterMode` counts every GEMM, so it must equal the
    formula with keys = T x T (the causal mask is applied after the matmul), all positions scored."""
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    t = 7
    ids = torch.randint(0, 50, (1, t))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids).logits.square().sum().backward()
    assert TRAIN_FORWARDS * TransformerFlops.from_model(model).forward(t, t * t, t) == counter.get_total_flops()


def test_causal_keys_count_each_token_its_context_and_itself():
    assert causal_keys(4) == 1 + 2 + 3 + 4
    assert causal_keys(3, context=5) == 6 + 7 + 8
    assert causal_keys(0, context=9) == 0


def _mask_keys(segments: list[tuple[int, int, int, int]], prefix_tokens: int) -> int:
    """Keys the packed attention's own mask lets the row's real tokens read."""
    layout = PackedLayout(segments, prefix_tokens, "cpu")
    lengths = torch.tensor([end - start for start, end, _, _ in segments])
    real = torch.arange(layout.q_len) < lengths[:, None]
    return int(layout.mask[:, 0][real].sum())


@pytest.mark.parametrize("group_size", [1, 4])
def test_shared_prefix_counts_are_the_packed_attention_masks(group_size):
    """The shared-prefix counts equal what the packed passes attend (their masks), and with one sample per
    prompt they equal the dense counts: the packed rows then hold exactly the dense tokens."""
    batch = rollout_batch(12, prompt_len=8, response_len=6, group_size=group_size, seed=1)
    plan = SharedPrefixPlan(batch)
    _, _, prefix_attention = plan.prefix_inputs("cpu")
    row = plan.suffix_row(list(range(len(batch))), None, "cpu")
    tokens, keys, scored = forward_counts(batch, plan)
    assert tokens == plan.prefix_tokens() + plan.suffix_tokens()
    assert keys == _mask_keys(prefix_attention.segments, 0) + _mask_keys(row.attention.segments,
                                                                          plan.prefix_tokens())
    assert scored == len(row.labels) == int(batch["response_mask"].sum())
    dense = forward_counts(batch, None)
    mask = batch["attention_mask"].bool()
    assert dense == (int(mask.sum()), int(mask.long().cumsum(-1)[mask].sum()), scored)  # position t reads t keys
    if group_size == 1:
        assert (tokens, keys, scored) == dense
    else:
        assert tokens < dense[0] and keys < dense[1]


def test_generation_counts_one_prefill_per_prompt_and_one_step_per_fed_back_token():
    prompts, responses = [3, 5], [2, 1, 4, 0]  # two samples per prompt
    tokens, keys, scored = 0, 0, 0
    for p in prompts:  # prefill: every prompt token, causal; its last position is scored
        tokens, keys, scored = tokens + p, keys + sum(range(1, p + 1)), scored + 1
    for i, r in enumerate(responses):
        for j in range(r - 1):  # token j goes back in at position p + j and reads p + j + 1 keys
            tokens, keys, scored = tokens + 1, keys + prompts[i // 2] + j + 1, scored + 1
    assert generation_counts(prompts, responses) == (tokens, keys, scored)


def test_value_model_counts_a_one_output_head():
    from torchrlhf.models.heads import ValueModel

    lm = build_tiny_causal_lm(vocab_size=64)
    counts = TransformerFlops.from_model(ValueModel(lm.config, backbone=lm.model))
    assert counts.head_out == 1 and counts.block_params == TransformerFlops.from_model(lm).block_params


def test_peak_is_given_or_measured():
    try:
        flops.set_peak_flops(3e12)
        assert flops.peak_flops(torch.float32, torch.device("cpu")) == 3e12
        flops.set_peak_flops(None)
        measured = flops.peak_flops(torch.float32, torch.device("cpu"))
        assert math.isfinite(measured) and measured > 0
        with pytest.raises(ValueError, match="must be > 0"):
            flops.set_peak_flops(0.0)
    finally:
        flops.set_peak_flops(None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_from=None, vocab_size=128))


@pytest.mark.parametrize("shared", [False, True])
def test_update_counts_every_mini_batch_and_epoch_and_reports_mfu(model_dir, shared, monkeypatch):
    """`train`'s FLOPs: 3 forwards of each mini-batch's tokens, every epoch; the MFU is reported per role."""
    from torchrlhf.workers import ActorWorker, Batching
    from torchrlhf.workers.microbatch import strided_mini_batches

    batch = rollout_batch(8, group_size=4, seed=2)
    actor = ActorWorker(model_dir, run={"rollout_n": 4}, shared_prefix=shared,
                        batching=Batching(ppo_mini_batch_size=1, ppo_micro_batch_size_per_device=2, ppo_epochs=2))
    seen: list[float] = []
    real_mfu = actor.mfu
    monkeypatch.setattr(actor, "mfu", lambda f, s: seen.append(f) or real_mfu(f, s))
    metrics = actor.update(batch, temperature=1.0)
    model = TransformerFlops.from_model(actor.model)
    minis = strided_mini_batches(batch, 2)  # samples 0, 2, 4, 6 and 1, 3, 5, 7: two of each prompt
    per_epoch = sum(model.forward(*forward_counts(m, SharedPrefixPlan(m) if shared else None)) for m in minis)
    assert seen == [2 * TRAIN_FORWARDS * per_epoch]
    assert 0 < metrics["perf/mfu/actor"] < 1
    out = actor.compute_log_prob(batch, temperature=1.0)
    assert 0 < out.meta["perf/mfu/old_log_prob"] < 1
    assert seen[-1] == model.forward(*forward_counts(batch, SharedPrefixPlan(batch) if shared else None))


def test_lora_training_count_equals_flop_counter_mode():
    """A LoRA model (frozen base and head, trained adapters): its base matmuls and the head compute no weight
    gradients, attention and the adapters do. The input embeddings are made to need a gradient so that the
    first block's input gradients are computed too (a recipe run skips them: the count is then an upper bound)."""
    from torchrlhf.models.lora import LoRAConfig, inject_lora

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    inject_lora(model, LoRAConfig(rank=4, alpha=8.0))
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith((".lora_A", ".lora_B")))
    t = 7
    embeds = model.get_input_embeddings()(torch.randint(0, 50, (1, t))).detach().requires_grad_(True)
    # `LoRALinear` accumulates its adapter product in place (``addmm_``), which FlopCounterMode does not count
    # by default: count it as the out-of-place addmm it is (2 m k n for m x k @ k x n)
    def addmm_inplace(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]

    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: addmm_inplace}) as counter:
        model(inputs_embeds=embeds).logits.square().sum().backward()
    count = TransformerFlops.from_model(model)
    # per layer, rank 4 x (in + out) of q 32->32, k 32->16, v 32->16, o 32->32, gate and up 32->48, down 48->32
    assert count.adapter_params == 3 * 4 * (64 + 48 + 48 + 64 + 2 * 80 + 80)
    assert count.train(t, t * t, t) == counter.get_total_flops()
