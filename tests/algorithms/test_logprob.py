import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchrlhf.algorithms import log_probs_from_hidden

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from dist_helpers import run_ranks  # noqa: E402


def test_log_probs_and_entropy_by_hand():
    # hidden [1, 0] through rows [0, 0] and [ln 3, 0]: logits [0, ln 3] -> softmax [1/4, 3/4]
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    weight = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    lp, h = log_probs_from_hidden(hidden, weight, torch.tensor([0, 1]))
    torch.testing.assert_close(lp, torch.tensor([math.log(0.25), math.log(0.75)]))
    want = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(h, torch.tensor([want, want]))
    # T = 2 halves the logits: softmax [1, sqrt 3] / (1 + sqrt 3)
    lp, _ = log_probs_from_hidden(hidden, weight, torch.tensor([0, 1]), temperature=2.0)
    r3 = math.sqrt(3.0)
    torch.testing.assert_close(lp, torch.tensor([-math.log(1 + r3), math.log(r3 / (1 + r3))]))


def _dense(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float):
    """The reference: float64 logits for every position, a full log-softmax, -sum p log p."""
    log_p = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, -1)
    return log_p.gather(-1, labels[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1)


def _inputs(seed: int, shape=(3, 5), dim: int = 6, vocab: int = 13):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, dim, generator=g).requires_grad_()
    weight = torch.randn(vocab, dim, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, shape, generator=g)
    return hidden, weight, labels, torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
@pytest.mark.parametrize("chunk_size,vocab_chunk_size", [(1, 1), (4, 5), (4, 13), (1024, 4), (1024, 4096)])
def test_values_and_grads_match_the_dense_computation(temperature, chunk_size, vocab_chunk_size):
    hidden, weight, labels, w_lp, w_h = _inputs(3)
    ref_lp, ref_h = _dense(hidden, weight, labels, temperature)
    ref_grads = torch.autograd.grad((ref_lp * w_lp + ref_h * w_h).sum(), (hidden, weight))
    lp, h = log_probs_from_hidden(hidden, weight, labels, temperature, chunk_size=chunk_size,
                                  vocab_chunk_size=vocab_chunk_size)
    assert lp.dtype == h.dtype == torch.float32 and lp.shape == labels.shape
    torch.testing.assert_close(lp, ref_lp.float())
    torch.testing.assert_close(h, ref_h.float())
    grads = torch.autograd.grad((lp * w_lp + h * w_h).sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float())


def test_running_max_rescales_when_a_later_tile_holds_larger_logits():
    # logits rising by 40 per vocabulary tile: every tile's max overtakes the running one, and exp(z - m)
    # of the first tiles would underflow to 0 without the rescaling (the labels sit in the early tiles)
    hidden, weight, labels, w_lp, w_h = _inputs(8, shape=(6,), dim=4, vocab=12)
    with torch.no_grad():
        hidden[:, 0] = 1.0
        weight[:, 0] = 40.0 * (torch.arange(12) // 3)
    labels = torch.tensor([0, 1, 3, 4, 9, 11])
    ref_lp, ref_h = _dense(hidden, weight, labels, 1.0)
    ref_grads = torch.autograd.grad((ref_lp * w_lp + ref_h * w_h).sum(), (hidden, weight))
    lp, h = log_probs_from_hidden(hidden, weight, labels, chunk_size=4, vocab_chunk_size=3)
    torch.testing.assert_close(lp, ref_lp.float())
    torch.testing.assert_close(h, ref_h.float())
    grads = torch.autograd.grad((lp * w_lp + h * w_h).sum(), (hidden, weight))
    # backward forms p = exp(z - lse): lse ~ 120 carries float32 rounding (7.6e-6), times |W| ~ 120 in dL/dh
    # (one vocabulary tile gives the same error); a missed rescale would be off by O(1)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float(), atol=2e-3, rtol=1e-4)


def test_log_prob_gradient_alone_when_the_entropy_is_unused():
    hidden, weight, labels, w_lp, _ = _inputs(4)
    ref_lp, _ = _dense(hidden, weight, labels, 0.8)
    ref_grads = torch.autograd.grad((ref_lp * w_lp).sum(), (hidden, weight))
    lp, _ = log_probs_from_hidden(hidden, weight, labels, 0.8, chunk_size=2, vocab_chunk_size=5)
    grads = torch.autograd.grad((lp * w_lp).sum(), (hidden, weight))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want.float())


def test_compiled_tiles_match_the_dense_computation():
    # `compile=True` (actor.compile) runs each tile's arithmetic through torch.compile: same values and
    # gradients, with ragged last tiles (13 = 5 + 5 + 3 vocabulary rows, 15 = 4 + 4 + 4 + 3 positions),
    # the entropy's gradient used and unused, and a second batch of another length (dynamic shapes)
    for seed, shape in ((3, (3, 5)), (9, (2, 7))):
        hidden, weight, labels, w_lp, w_h = _inputs(seed, shape=shape)
        ref_lp, ref_h = _dense(hidden, weight, labels, 0.7)
        lp, h = log_probs_from_hidden(hidden, weight, labels, 0.7, chunk_size=4, vocab_chunk_size=5, compile=True)
        torch.testing.assert_close(lp, ref_lp.float())
        torch.testing.assert_close(h, ref_h.float())
        for ref_loss, loss in (((ref_lp * w_lp + ref_h * w_h).sum(), (lp * w_lp + h * w_h).sum()),
                               ((ref_lp * w_lp).sum(), (lp * w_lp).sum())):
            grads = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
            for got, want in zip(grads, torch.autograd.grad(ref_loss, (hidden, weight), retain_graph=True)):
                torch.testing.assert_close(got, want.float())


def test_keeps_no_vocabulary_sized_tensor_for_backward():
    hidden, weight, labels, _, _ = _inputs(5, shape=(4, 8), vocab=64)
    lp, _ = log_probs_from_hidden(hidden, weight, labels, chunk_size=3, vocab_chunk_size=16)
    saved = lp.grad_fn.next_functions[0][0].saved_tensors
    n = labels.numel()
    assert {tuple(t.shape) for t in saved} == {(n, 6), (64, 6), (n,)}  # hidden, weight, labels / lse / entropy


def test_bf16_inputs_reduce_in_float32():
    hidden, weight, labels, _, _ = _inputs(6)
    h16, w16 = hidden.detach().bfloat16().requires_grad_(), weight.detach().bfloat16().requires_grad_()
    lp, h = log_probs_from_hidden(h16, w16, labels, vocab_chunk_size=5)
    ref_lp, ref_h = _dense(h16.detach(), w16.detach(), labels, 1.0)
    # the bf16 matmul rounds the logits (|z| < 20 here: steps of 0.125 at most); the reductions are float32
    torch.testing.assert_close(lp, ref_lp.float(), atol=0.1, rtol=0.02)
    torch.testing.assert_close(h, ref_h.float(), atol=0.1, rtol=0.02)
    (lp.sum() + h.sum()).backward()
    assert h16.grad.dtype == w16.grad.dtype == torch.bfloat16 and torch.isfinite(w16.grad.float()).all()


def test_bad_inputs_are_refused():
    hidden, weight, labels = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="do not match labels"):
        log_probs_from_hidden(hidden, weight, labels[:, :2])
    with pytest.raises(ValueError, match="hidden size"):
        log_probs_from_hidden(hidden, torch.zeros(5, 3), labels)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        log_probs_from_hidden(hidden, weight, labels, 0.0)
    with pytest.raises(ValueError, match="chunk_size and vocab_chunk_size must be >= 1"):
        log_probs_from_hidden(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size and vocab_chunk_size must be >= 1"):
        log_probs_from_hidden(hidden, weight, labels, vocab_chunk_size=0)


def _vocab_parallel(rank: int, world_size: int, out: str) -> None:
    hidden, weight, labels, w_lp, w_h = _inputs(7, vocab=13)  # 13 rows over 2 ranks: 7 + 6
    rows = torch.arange(13).chunk(world_size)[rank]
    local = weight.detach()[rows].requires_grad_()
    lp, h = log_probs_from_hidden(hidden, local, labels, 0.9, chunk_size=4, vocab_chunk_size=3,
                                  group=dist.group.WORLD, vocab_start=int(rows[0]))
    grad_hidden, grad_local = torch.autograd.grad((lp * w_lp + h * w_h).sum(), (hidden, local))
    parts = [None] * world_size
    dist.all_gather_object(parts, grad_local)
    if rank == 0:
        torch.save({"lp": lp, "h": h, "grad_hidden": grad_hidden, "grad_weight": torch.cat(parts)}, out)


def test_vocabulary_split_over_two_ranks_matches_the_dense_computation(tmp_path):
    out = tmp_path / "vp.pt"
    run_ranks(_vocab_parallel, 2, str(out))
    got = torch.load(out, weights_only=True)
    hidden, weight, labels, w_lp, w_h = _inputs(7, vocab=13)
    ref_lp, ref_h = _dense(hidden, weight, labels, 0.9)
    grad_hidden, grad_weight = torch.autograd.grad((ref_lp * w_lp + ref_h * w_h).sum(), (hidden, weight))
    torch.testing.assert_close(got["lp"], ref_lp.float())
    torch.testing.assert_close(got["h"], ref_h.float())
    torch.testing.assert_close(got["grad_hidden"], grad_hidden.float())
    torch.testing.assert_close(got["grad_weight"], grad_weight.float())


def test_the_head_reads_labels_without_a_host_sync():
    """No op whose output size depends on the data (``nonzero``, boolean indexing): on a GPU each would wait
    for the device once per tile, and the H100 profile of a 1.07 B update showed thousands of them."""
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        lp, h = log_probs_from_hidden(hidden, weight, labels, 0.7, chunk_size=8, vocab_chunk_size=7)
        (lp.sum() + h.sum()).backward()
    names = {e.name for e in prof.events()}
    assert "aten::addmm" in names or "aten::mm" in names  # the profile saw the head's work
    assert not names & {"aten::nonzero", "aten::masked_select", "aten::index", "aten::item", "aten::_local_scalar_dense"}
