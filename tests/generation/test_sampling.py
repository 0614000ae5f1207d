"""The batched sampler against hand-derived distributions."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.generation import SamplingParams, sample_tokens
from torchrlhf.generation.sampling import prompt_seed_for, request_uniforms, sample_seed

from gen_helpers import HostReads


def test_params_validation():
    for bad in (dict(n=0), dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(min_p=2), dict(max_tokens=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams().logprobs is True


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**62 + 7, 2**63 - 1])
def test_prompt_seed_for_picks_the_seed_of_sample_0(seed):
    """A caller that generates one sample per prompt can give each the seed it wants (agent rounds)."""
    assert sample_seed(prompt_seed_for(seed), 0) == seed
    assert 0 <= prompt_seed_for(seed) < 2**63  # fits an int64 seed column


def test_greedy_is_argmax_with_untempered_logprob():
    logits = torch.randn(5, 11)
    logits[1, 3] = logits[1, 8] = logits[1].max() + 1  # a tie: the first index, as argmax (and HF greedy)
    tok, lp = sample_tokens(logits, torch.rand(5, dtype=torch.float64), SamplingParams(temperature=0))
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])


def test_inverse_cdf_hand_derived():
    # probs 0.1, 0.2, 0.3, 0.4 -> cumulative 0.1, 0.3, 0.6, 1.0
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log().repeat(4, 1)
    u = torch.tensor([0.05, 0.29, 0.31, 0.99], dtype=torch.float64)
    tok, lp = sample_tokens(logits, u, SamplingParams(temperature=1.0))
    assert tok.tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(lp, torch.tensor([0.1, 0.2, 0.3, 0.4]).log())


def test_temperature_scales_logprob_not_filtered():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    tok, lp = sample_tokens(logits, torch.tensor([0.999], dtype=torch.float64), SamplingParams(temperature=0.5, top_k=2))
    assert tok.item() == 2  # top-2 = {3, 2}; u near 1 picks the less likely one
    assert lp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 2].item(), abs=1e-6)


def _frequencies(logits: torch.Tensor, params: SamplingParams, draws: int = 20000) -> torch.Tensor:
    u = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok, _ = sample_tokens(logits.expand(draws, -1), u, params)
    return torch.bincount(tok, minlength=logits.shape[-1]).double() / draws


def test_top_k_distribution():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(1))
    freq = _frequencies(logits, SamplingParams(temperature=0.8, top_k=4))
    top = (logits[0] / 0.8).topk(4).indices
    outside = torch.ones(30, dtype=torch.bool)
    outside[top] = False
    assert freq[outside].sum() == 0
    expected = torch.softmax(logits[0, top] / 0.8, -1).double()
    torch.testing.assert_close(freq[top], expected, atol=0.015, rtol=0)


def test_top_p_and_min_p_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    # top_p=0.8: 0.5 + 0.25 = 0.75 < 0.8, so 0.15 joins; renormalised over the first three.
    freq = _frequencies(probs.log()[None], SamplingParams(top_p=0.8))
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0, 0], dtype=torch.float64) / 0.9, atol=0.015, rtol=0)
    # min_p=0.2: threshold 0.1 keeps the first three.
    freq = _frequencies(probs.log()[None], SamplingParams(min_p=0.2))
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.25, 0.15, 0, 0], dtype=torch.float64) / 0.9, atol=0.015, rtol=0)


def test_request_uniforms_depend_only_on_seed_and_sample():
    a = request_uniforms(7, 1, 10)
    assert torch.equal(a, request_uniforms(7, 1, 10))
    assert not torch.equal(a, request_uniforms(7, 0, 10))
    assert not torch.equal(a, request_uniforms(8, 1, 10))
    assert ((a >= 0) & (a < 1)).all()


def _textbook_tokens(probs: torch.Tensor, u: torch.Tensor, top_p: float = 1.0) -> torch.Tensor:
    """Inverse CDF with one float64 cumsum over the whole vocabulary (sorted by probability when top_p < 1)."""
    order = torch.arange(probs.shape[-1]).expand_as(probs)
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs >= top_p, 0.0)
    cdf = probs.double().cumsum(-1)
    pos = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)
    return order.gather(-1, pos).squeeze(-1)


def test_two_level_inverse_cdf_matches_one_full_cumsum(monkeypatch):
    from torchrlhf.generation import sampling

    monkeypatch.setattr(sampling, "CDF_BLOCK", 64)  # 1000 tokens -> 16 blocks, the last one padded
    draws = 4000
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3)).mul(2).expand(draws, -1)
    u = torch.rand(draws, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    tok, lp = sample_tokens(logits, u, SamplingParams(temperature=1.0))
    expected = _textbook_tokens(torch.softmax(logits, -1), u)
    # The block sums are float32, so a draw within ~1e-7 of a token boundary may land one token over.
    assert (tok == expected).float().mean() >= 0.999
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])


def test_top_p_candidates_widen_to_match_a_full_sort(monkeypatch):
    from torchrlhf.generation import sampling

    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 8)
    gen = torch.Generator().manual_seed(5)
    # Peaked rows hold top_p within 8 candidates; flat rows need the search to widen (to 32, 128, then all 300).
    logits = torch.cat([torch.randn(50, 300, generator=gen) * 4, torch.randn(50, 300, generator=gen) * 0.1])
    u = torch.rand(100, generator=gen, dtype=torch.float64)
    tok, _ = sample_tokens(logits, u, SamplingParams(temperature=1.0, top_p=0.9))
    assert torch.equal(tok, _textbook_tokens(torch.softmax(logits, -1), u, top_p=0.9))


def test_top_p_on_an_accelerator_sorts_every_token_and_reads_nothing_from_the_device(monkeypatch):
    """The sort an accelerator takes (`sorts_whole_vocabulary`), here forced on a CPU: the same tokens as the
    textbook nucleus, and no value read back (the candidate search reads one every step)."""
    from torchrlhf.generation import sampling

    gen = torch.Generator().manual_seed(7)
    logits = torch.cat([torch.randn(20, 3000, generator=gen) * 4, torch.randn(20, 3000, generator=gen) * 0.1])
    u = torch.rand(40, generator=gen, dtype=torch.float64)
    params = SamplingParams(temperature=0.9, top_p=0.8)
    expected = _textbook_tokens(torch.softmax(logits / 0.9, -1), u, top_p=0.8)
    reads = {}
    for whole in (False, True):
        monkeypatch.setattr(sampling, "sorts_whole_vocabulary", lambda device: whole)
        with HostReads() as mode:
            tok, _ = sample_tokens(logits, u, params, check_finite=False)
        reads[whole] = mode.count
        assert torch.equal(tok, expected), whole
    assert reads == {False: 1, True: 0}


@pytest.mark.parametrize("vocab", [40, 5000])  # one-level and two-level inverse CDF
def test_a_rounding_overshoot_never_picks_a_filtered_token(vocab):
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(6)) * 3
    logits[:, -1] = -1e4  # the last token has zero probability even before filtering
    u = torch.ones(3, dtype=torch.float64)  # u = 1 is the overshoot that rounding can produce
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, min_p=0.3)):
        tok, lp = sample_tokens(logits, u, params)
        probs = torch.softmax(logits, -1)
        kept = probs >= params.min_p * probs.amax(-1, keepdim=True)
        assert bool(kept.gather(-1, tok[:, None]).all()) and torch.isfinite(lp).all()
        assert (tok < vocab - 1).all()


@pytest.mark.parametrize("vocab", [64, 5000])  # one cumulative sum, and the two-level search
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(top_k=5), SamplingParams(top_p=0.9),
    SamplingParams(min_p=0.1),
], ids=["greedy", "full", "top_k", "top_p", "min_p"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_raise_naming_the_rows(vocab, params, bad):
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    uniforms = torch.rand(4, generator=torch.Generator().manual_seed(1))
    sample_tokens(logits, uniforms, params)  # finite: fine
    logits[2, 7] = bad
    with pytest.raises(FloatingPointError, match=r"rows \[2\] is not finite"):
        sample_tokens(logits, uniforms, params)
