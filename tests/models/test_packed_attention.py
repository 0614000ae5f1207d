"""Packed attention with a cached prompt K/V inside the HF forward == a plain padded HF forward (values and grads)."""

from __future__ import annotations

import torch

from torchrlhf.data import Batch
from torchrlhf.models import build_tiny_causal_lm
from torchrlhf.models.packed_attention import ATTN_IMPLEMENTATION, sliding_window
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, prefix_forward, scatter_responses, suffix_forward

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


def test_pieces_equal_slices_in_value_and_gradient():
    from torchrlhf.models.packed_attention import _pieces

    torch.manual_seed(0)
    x = torch.randn(1, 2, 10, 3, requires_grad=True)
    # repeated ranges (one prompt, many samples), disjoint ones, one spanning two pieces, a gap (7..8)
    ranges = [(0, 4), (0, 4), (4, 7), (2, 6), (8, 10)]
    pieces = _pieces(x, ranges)
    weights = [torch.randn(1, 2, b - a, 3) for a, b in ranges]
    sum((pieces[a, b] * w).sum() for (a, b), w in zip(ranges, weights)).backward()
    expected = torch.zeros_like(x)
    for (a, b), w in zip(ranges, weights):
        assert torch.equal(pieces[a, b], x[:, :, a:b])
        expected[:, :, a:b] += w
    torch.testing.assert_close(x.grad, expected)
