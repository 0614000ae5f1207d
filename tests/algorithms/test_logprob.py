import math

import pytest
import torch

from torchrlhf.algorithms import entropy_from_logits, log_probs_from_logits


def test_log_probs_by_hand():
    # logits [0, ln 3] -> softmax [1/4, 3/4]
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    out = log_probs_from_logits(logits, torch.tensor([[0, 1]]))
    torch.testing.assert_close(out, torch.tensor([[math.log(0.25), math.log(0.75)]]))


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024])
def test_log_probs_match_log_softmax_values_and_grads(chunk_size):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    weights = torch.randn(2, 5, generator=g)
    ref = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    out = log_probs_from_logits(logits, labels, chunk_size=chunk_size)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.float())
    (grad,) = torch.autograd.grad((out * weights).sum(), logits)
    torch.testing.assert_close(grad, ref_grad.float())


def test_log_probs_bf16():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 9, generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, 9, (3, 4), generator=g)
    out = log_probs_from_logits(logits, labels, chunk_size=5)
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, ref)  # upcast before the reduction: as exact as float32 on bf16 values
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_log_probs_saves_no_vocab_sized_float_copy():
    logits = torch.randn(2, 6, 50, dtype=torch.bfloat16, requires_grad=True)
    out = log_probs_from_logits(logits, torch.zeros(2, 6, dtype=torch.long), chunk_size=4)
    saved = [t for t in out.grad_fn.next_functions[0][0].saved_tensors if t.numel() >= logits.numel()]
    assert all(t.dtype == torch.bfloat16 for t in saved)  # only the logits themselves, not a float log-softmax


def test_log_probs_shape_error():
    with pytest.raises(ValueError, match="labels"):
        log_probs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_entropy_by_hand_and_reference():
    # uniform over 4 -> ln 4; one-hot-ish (huge logit) -> ~0
    torch.testing.assert_close(entropy_from_logits(torch.zeros(1, 4)), torch.tensor([math.log(4.0)]))
    assert entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 7, generator=g, requires_grad=True)
    ref = torch.zeros(2, 3, dtype=torch.float64)
    for i in range(2):  # -sum p log p, one distribution at a time
        for t in range(3):
            p = torch.softmax(logits[i, t].double(), -1)
            ref[i, t] = -(p * p.log()).sum()
    out = entropy_from_logits(logits)
    torch.testing.assert_close(out, ref.float())
    (grad,) = torch.autograd.grad(out.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
    torch.testing.assert_close(grad, ref_grad.float())
    out16 = entropy_from_logits(logits.detach().bfloat16())
    assert out16.dtype == torch.float32 and torch.isfinite(out16).all()


def _dense(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """The reference: a float64 log-softmax of the scaled logits, and -sum p log p."""
    log_p = torch.log_softmax(logits.double() / temperature, -1)
    return log_p.gather(-1, labels[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_temperature_is_applied_inside_values_and_grads(temperature, chunk_size):
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(3, 5, 13, generator=g)).requires_grad_()
    labels = torch.randint(0, 13, (3, 5), generator=g)
    w_lp, w_h = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    ref_lp, ref_h = _dense(logits, labels, temperature)
    (ref_grad,) = torch.autograd.grad((ref_lp * w_lp + ref_h * w_h).sum(), logits)
    lp = log_probs_from_logits(logits, labels, temperature, chunk_size=chunk_size)
    h = entropy_from_logits(logits, temperature, chunk_size=chunk_size)
    torch.testing.assert_close(lp, ref_lp.float())
    torch.testing.assert_close(h, ref_h.float())
    (grad,) = torch.autograd.grad((lp * w_lp + h * w_h).sum(), logits)
    torch.testing.assert_close(grad, ref_grad.float())


def test_entropy_saves_no_vocab_sized_float_copy():
    logits = torch.randn(2, 6, 50, dtype=torch.bfloat16, requires_grad=True)
    out = entropy_from_logits(logits, 0.7, chunk_size=4)
    saved = [t for t in out.grad_fn.next_functions[0][0].saved_tensors if t.numel() >= logits.numel()]
    assert saved and all(t.dtype == torch.bfloat16 for t in saved)
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_bad_temperature_or_chunk_is_refused():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_from_logits(torch.zeros(1, 3), torch.zeros(1, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        entropy_from_logits(torch.zeros(1, 3), chunk_size=0)
