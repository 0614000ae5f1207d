"""Packed attention with a cached prompt K/V inside the HF forward == a plain padded HF forward (values and grads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from torchrlhf.data import Batch
from torchrlhf.models import build_tiny_causal_lm
from torchrlhf.models.packed_attention import (
    ATTN_IMPLEMENTATION,
    PackedAttention,
    PackedLayout,
    sdpa,
    sliding_window,
)
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, prefix_forward, scatter_responses, suffix_forward

LAYER_0 = SimpleNamespace(layer_idx=0)  # what a plan reads of the HF attention module
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [3]]  # the last one: an empty prefix
RESPONSES = [[20, 21], [], [22, 23, 24, 25, 26], [30], [31, 32, 33], [40, 41, 42, 43, 44], [50, 51, 52]]
GROUP = [0, 0, 0, 1, 1, 2, 2]


def _batch() -> Batch:
    p, r = 6, 5
    b = len(RESPONSES)
    ids = torch.full((b, p + r), 2)
    mask = torch.zeros(b, p + r, dtype=torch.long)
    responses = torch.full((b, r), 2)
    for i, (g, resp) in enumerate(zip(GROUP, RESPONSES)):
        prompt = PROMPTS[g]
        ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        mask[i, p - len(prompt) : p + len(resp)] = 1
        if resp:
            ids[i, p : p + len(resp)] = torch.tensor(resp)
            responses[i, : len(resp)] = torch.tensor(resp)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch({"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": responses})


def test_packed_forward_and_backward_equal_the_padded_hf_forward():
    torch.manual_seed(0)
    model = build_tiny_causal_lm(vocab_size=64)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    batch = _batch()
    r = batch["responses"].shape[1]
    resp_mask = batch["attention_mask"][:, -r:].float()
    weights = torch.randn(len(RESPONSES), r)

    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                   position_ids=batch["position_ids"]).logits[:, -r - 1 : -1]
    dense = torch.log_softmax(logits, -1).gather(-1, batch["responses"][..., None]).squeeze(-1) * resp_mask
    (dense * weights).sum().backward()
    dense_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    plan = SharedPrefixPlan(batch)
    assert plan.num_groups == 3
    prefix = prefix_forward(model, plan, "cpu")
    packed = torch.zeros(len(RESPONSES), r)
    for rows in ([0, 3], [1, 2, 4, 6], [5]):  # every group split over micro-batches
        row = plan.suffix_row(rows, prefix, "cpu")
        lp = torch.log_softmax(suffix_forward(model, row), -1).gather(-1, row.labels[:, None]).squeeze(-1)
        out = scatter_responses(lp, row, len(rows), r)
        (out * weights[rows]).sum().backward()
        packed[rows] = out.detach()
    prefix.backward()

    torch.testing.assert_close(packed, dense.detach(), atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, dense_grads[name], atol=1e-6, rtol=1e-4, msg=name)


def test_sliding_window_is_reported_only_when_in_use():
    model = build_tiny_causal_lm(vocab_size=64)
    assert sliding_window(model.config) is None
    model.config.use_sliding_window, model.config.sliding_window = True, 16
    assert sliding_window(model.config) == 16


def _segment_reference(q, k, v, pk, pv, segments, scale):
    """One SDPA call per segment with its mask spelled out: the prompt's keys, then causal over its own."""
    outs = []
    for start, end, p_start, p_end in segments:
        ks = torch.cat([pk[:, :, p_start:p_end], k[:, :, start:end]], dim=2)
        vs = torch.cat([pv[:, :, p_start:p_end], v[:, :, start:end]], dim=2)
        n, p = end - start, p_end - p_start
        mask = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p)
        outs.append(F.scaled_dot_product_attention(q[:, :, start:end], ks, vs, attn_mask=mask, scale=scale,
                                                   enable_gqa=True))
    return torch.cat(outs, dim=2).transpose(1, 2)


def test_one_batched_call_equals_one_call_per_segment_in_value_and_gradient():
    """`PackedAttention` pads every segment into one SDPA call: the same outputs and gradients (to rounding:
    the padded keys change the kernel's block sizes) as a call per segment, padding rows included."""
    torch.manual_seed(0)
    heads, kv_heads, dim, scale = 4, 2, 8, 0.3
    # prompts at 0:5, 5:12, 12:12 (empty); samples of lengths 3, 1, 6, 2 reading them, one prompt twice
    segments = [(0, 3, 0, 5), (3, 4, 5, 12), (4, 10, 12, 12), (10, 12, 0, 5)]
    t, p = 12, 12
    leaves = [torch.randn(1, h, n, dim, requires_grad=True)
              for h, n in ((heads, t), (kv_heads, t), (kv_heads, t), (kv_heads, p), (kv_heads, p))]
    q, k, v, pk, pv = leaves
    weights = torch.randn(1, t, heads, dim)

    class Prefix:
        def get(self, layer):
            return pk, pv

    got = PackedAttention(segments, prefix=Prefix()).attend(LAYER_0, q, k, v, scale)
    grads = torch.autograd.grad((got * weights).sum(), leaves)
    want = _segment_reference(q, k, v, pk, pv, segments, scale)
    want_grads = torch.autograd.grad((want * weights).sum(), leaves)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for name, g, w in zip("q k v pk pv".split(), grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=name)

    # a prefix pass (no prompt keys, causal segments): the same against the reference with empty prompts
    prompts = [(0, 5, 0, 0), (5, 12, 0, 0)]
    got = PackedAttention(prompts, record=True).attend(LAYER_0, q, k, v, scale)
    torch.testing.assert_close(got, _segment_reference(q, k, v, pk, pv, prompts, scale), atol=1e-6, rtol=1e-5)


def test_layout_refuses_segments_that_do_not_cover_the_row_in_order():
    with pytest.raises(ValueError, match="cover the row in order"):
        PackedLayout([(0, 3, 0, 0), (4, 6, 0, 0)], 0, "cpu")


def _attention_f64(q, k, v, mask):
    """Masked softmax attention written out in float64, GQA by repeating K/V heads."""
    rep = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(rep, 1) for x in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def test_bf16_attention_on_cpu_runs_in_fp32_and_returns_bf16():
    """`sdpa` on bf16 inputs: bf16 out, within one bf16 rounding of a float64 reference (the bf16 kernel's
    own softmax and products round in bf16), and gradients reach the bf16 inputs."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 5, 16, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(3, 2, 7, 16, generator=g).bfloat16().requires_grad_() for _ in range(2))
    mask = (torch.rand(3, 1, 5, 7, generator=g) > 0.4) | (torch.arange(7) == 0)
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    ref = _attention_f64(q, k, v, mask)
    assert out.dtype == torch.bfloat16
    # fp32 math, one rounding to bf16 at the end: |out - ref| <= half a bf16 ulp (2^-8 relative) + fp32 noise
    torch.testing.assert_close(out.double(), ref, rtol=2**-8, atol=1e-6)
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.bfloat16 and q.grad.abs().sum() > 0 and v.grad.abs().sum() > 0
    # fp32 inputs are left to the kernel as they are
    q32, k32, v32 = (x.detach().float() for x in (q, k, v))
    torch.testing.assert_close(sdpa(q32, k32, v32, attn_mask=mask, enable_gqa=True),
                               F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, enable_gqa=True),
                               rtol=0, atol=0)
