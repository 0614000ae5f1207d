"""LogProbHead inside a HF causal LM == the plain HF model's logits and log-softmax (values and grads)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchrlhf.models import build_tiny_causal_lm
from torchrlhf.models.lm_head import LogProbHead


@pytest.mark.parametrize("tied", [True, False])
def test_install_keeps_names_ties_and_logits(tied):
    ref = build_tiny_causal_lm(vocab_size=64, tie_word_embeddings=tied)
    model = copy.deepcopy(ref)
    head = LogProbHead.install(model)
    assert model.lm_head is head and type(ref.lm_head) is nn.Linear
    assert (head.weight is model.model.embed_tokens.weight) == tied
    assert list(model.state_dict()) == list(ref.state_dict())
    assert LogProbHead.install(model) is head  # idempotent
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_scoring_equals_the_log_softmax_of_hf_logits(temperature):
    ref = build_tiny_causal_lm(vocab_size=64)
    model = copy.deepcopy(ref)
    head = LogProbHead.install(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 9), generator=g)
    keep = torch.tensor([3, 4, 5, 7])  # positions whose next token is scored
    labels = ids[:, keep + 1]
    w_lp, w_h = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)

    log_p = torch.log_softmax(ref(input_ids=ids).logits[:, keep].double() / temperature, -1)
    ref_lp, ref_h = log_p.gather(-1, labels[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)
    (ref_lp * w_lp + ref_h * w_h).sum().backward()

    with head.scoring(labels, temperature):
        scores = model(input_ids=ids, logits_to_keep=keep).logits
    assert scores.shape == (2, 4, 2)
    lp, h = scores.unbind(-1)
    torch.testing.assert_close(lp, ref_lp.float())
    torch.testing.assert_close(h, ref_h.float())
    (lp * w_lp + h * w_h).sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-4, msg=name)
    assert model(input_ids=ids).logits.shape == (2, 9, 64)  # the request ended with its block


def test_entropy_grad_false_leaves_the_entropy_out_of_the_gradient():
    model = build_tiny_causal_lm(vocab_size=64)
    head = LogProbHead.install(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    keep, params = torch.tensor([3, 4, 5, 7]), list(model.parameters())

    def grads(entropy_grad: bool, entropy_weight: float):
        with head.scoring(ids[:, keep + 1], entropy_grad=entropy_grad):
            lp, h = model(input_ids=ids, logits_to_keep=keep).logits.unbind(-1)
        return h.detach(), torch.autograd.grad((lp + entropy_weight * h).sum(), params)

    h_off, off = grads(False, 1.0)
    h_on, on = grads(True, 1.0)
    _, log_prob_only = grads(True, 0.0)
    torch.testing.assert_close(h_off, h_on)  # the same values; only the graph differs
    for got, want in zip(off, log_prob_only):
        torch.testing.assert_close(got, want)
    assert any(not torch.allclose(a, b) for a, b in zip(on, log_prob_only))  # the entropy does have a gradient


def test_install_refuses_a_head_with_a_bias():
    model = build_tiny_causal_lm(vocab_size=64, tie_word_embeddings=False)
    model.lm_head = nn.Linear(64, 64, bias=True)
    with pytest.raises(ValueError, match="bias-free nn.Linear"):
        LogProbHead.install(model)


def test_no_kept_position_backpropagates_into_the_blocks_but_not_the_head():
    """A shared-prefix pass keeps no position: its empty output still reaches the layers in backward
    (FSDP2 gathers a block when the gradient reaches its output), but the head weight gets no gradient
    (a zero [V, D] one would be allocated and added for nothing)."""
    model = build_tiny_causal_lm(vocab_size=64, tie_word_embeddings=False)
    LogProbHead.install(model)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    reached = []
    model.model.layers[-1].register_full_backward_hook(lambda *_: reached.append(True))
    out = model(input_ids=ids, logits_to_keep=torch.zeros(0, dtype=torch.long)).logits
    assert out.shape == (1, 0, 64) and out.requires_grad
    assert out._base is None  # not a view: FSDP2 warns when its root module returns one
    out.backward(torch.zeros_like(out))
    assert reached, "the gradient did not reach the last block"
    assert model.lm_head.weight.grad is None
