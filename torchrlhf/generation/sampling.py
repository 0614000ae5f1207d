"""Sampling parameters and the batched token sampler.

Sampling draws one uniform number per (request, step) and inverts the CDF of the
filtered distribution. The uniforms come from a per-request `torch.Generator`
drawn once when the request enters the batch, so a request's samples depend only
on its seed and its own logits, never on which other requests share the batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to sample responses (one set for every prompt of a `generate` call).

    Args:
        n: samples per prompt; they share the prompt's prefill.
        temperature: logits are divided by it; 0 means greedy (argmax).
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p``.
        top_k: keep the ``top_k`` most likely tokens; -1 (or 0) turns it off.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's.
        max_tokens: most tokens generated per sample (the stop token included).
        stop_token_ids: extra token ids that end a sample (the tokenizer's EOS ids are
            added unless ``ignore_eos``); the stop token is kept in the response.
        stop: strings that end a sample once the decoded response contains one; the
            token that completes the string is the last one kept.
        seed: base seed; sample ``j`` of prompt ``i`` draws from a generator seeded by
            ``(seed + i, j)`` (or by the prompt batch's ``seed`` column when it has one),
            so its tokens do not depend on batch composition. None draws the base seed
            from torch's global RNG.
        logprobs: return the ``rollout_log_probs`` column (log_softmax(logits / T) of each
            sampled token; T = 1 when greedy).
        ignore_eos: do not stop on the tokenizer's EOS ids.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 128
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n: must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k: must be -1 (off) or >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("stop: must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the returned log-probs (and of the trainer's recomputation): 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0

    def greedy_copy(self) -> SamplingParams:
        """One greedy response per prompt, the rest unchanged (ReMax's baseline)."""
        return dataclasses.replace(self, n=1, temperature=0.0)


def sample_seed(seed: int, sample: int) -> int:
    """The seed of sample ``sample`` of a prompt seeded ``seed``, for every engine's sampler.

    Mixed rather than ``seed + sample``: prompt seeds are ``base + i``, so sample 1 of prompt i would
    otherwise reuse the draws of sample 0 of prompt i + 1.
    """
    return (seed * _SEED_MUL + sample * 7919 + _SEED_ADD) % _SEED_MOD


_SEED_MUL, _SEED_ADD, _SEED_MOD = 1_000_003, 0x9E3779B9, 2**63


def prompt_seed_for(seed: int) -> int:
    """The prompt seed whose sample 0 draws from ``seed``: `sample_seed` inverted (the multiplier is odd, so
    it has an inverse modulo 2**63). Lets a caller that generates one sample per prompt (the agent rounds of
    `torchrlhf.generation.base.generate_in_rounds`) choose each sample's seed through the ``seed`` column."""
    return (seed - _SEED_ADD) * pow(_SEED_MUL, -1, _SEED_MOD) % _SEED_MOD


def request_uniforms(seed: int, sample: int, steps: int) -> torch.Tensor:
    """The ``steps`` uniforms in [0, 1) that sample ``sample`` of a prompt seeded ``seed`` uses."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(sample_seed(seed, sample))
    return torch.rand(steps, generator=gen, dtype=torch.float64)


# The inverse CDF over a large vocabulary runs in two levels: block sums find the block
# that holds the target, then one block's cumulative sum finds the token. A full-vocab
# float64 cumsum per row per step would cost more than a decode step's attention.
CDF_BLOCK = 1024
# On a CPU, top-p looks for the nucleus among the top TOP_P_CANDIDATES tokens first (a partial
# sort) and widens only for rows whose candidates hold less than top_p of the mass.
TOP_P_CANDIDATES = 1024


def sorts_whole_vocabulary(device: torch.device) -> bool:
    """Whether top-p sorts every token instead of searching the top candidates. The search reads from the
    device (do the candidates hold the nucleus?): free on a CPU, where a full sort is what costs (22 ms for
    16 rows of 49 k tokens against 1.3 ms for the top 256, 2 threads). On an accelerator the read would make
    the host wait for the device every decode step, and a sort is cheap."""
    return device.type != "cpu"


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams, *, check_finite: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V] with the given uniforms [B].

    Returns (tokens [B] long, log-probs [B] float32) where the log-prob is of the
    temperature-scaled distribution before top-k/top-p/min-p filtering (the
    distribution the trainer recomputes). A token of zero probability is never returned.
    A row with NaN or inf logits raises FloatingPointError; with ``check_finite=False`` (the engine's
    decode loop, which must not wait for the device every step) its log-prob is NaN instead and the
    caller checks. Only top-p sampling on a CPU reads from the device (whether the candidates hold the
    nucleus; `sorts_whole_vocabulary`).
    """
    logits = logits.float()
    if params.greedy:
        # log p(argmax) = -log sum(exp(logits - max)): one reduction for the token and its logit, one for the
        # sum, no softmax kept (2x faster than argmax + softmax at a 49 k vocabulary on a CPU, batch 16-64).
        top, tokens = logits.max(dim=-1)
        log_probs = -(logits - top[:, None]).exp_().sum(dim=-1).log()
        if check_finite:
            _check_finite(log_probs)  # a row with a NaN or +inf logit has a NaN log-prob (inf - inf)
        return tokens, log_probs

    full = torch.softmax(logits / params.temperature if params.temperature != 1 else logits, dim=-1)
    probs, index = full, None
    if 0 < params.top_k < probs.shape[-1]:
        probs, index = probs.topk(params.top_k, dim=-1)  # sorted, most likely first
    elif params.top_p < 1:
        probs, index = _top_p_candidates(probs, params.top_p)
    if params.top_p < 1:
        # Keep a token while the mass before it is below top_p (the top token always stays).
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    if params.min_p > 0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    pos = _inverse_cdf(probs, uniforms.to(probs.device, torch.float64)[:, None], check_finite)
    tokens = (index.gather(-1, pos) if index is not None else pos).squeeze(-1)
    return tokens, _token_logprob(full, tokens)  # NaN where the row is not finite


def _check_finite(row_values: torch.Tensor) -> None:
    """Refuse rows whose distribution is not finite: sampling them would return arbitrary tokens."""
    bad = ~torch.isfinite(row_values)
    if bool(bad.any()):
        rows = bad.nonzero().flatten().tolist()
        raise FloatingPointError(
            f"sample_tokens: the next-token distribution of rows {rows[:8]} is not finite (NaN or inf logits): "
            "the model's weights or activations are not finite (a corrupt checkpoint, or an overflow in "
            "float16/bfloat16)"
        )


def _token_logprob(probs: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(token) from the softmax (the token has non-zero probability, so no -inf)."""
    return probs.gather(-1, tokens[:, None]).squeeze(-1).log()


def _top_p_candidates(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, index) of the most likely tokens, sorted, a prefix long enough to hold every row's nucleus.

    The nucleus is the sorted prefix whose mass before each token is below ``top_p``; when the
    top ``k`` hold at least ``top_p``, token ``k + 1`` and later are outside it, so sorting the
    top ``k`` gives exactly what sorting the whole vocabulary would. Where `sorts_whole_vocabulary`, the
    first try is the whole vocabulary, which needs no check (no read from the device).
    """
    vocab = probs.shape[-1]
    k = vocab if sorts_whole_vocabulary(probs.device) else min(TOP_P_CANDIDATES, vocab)
    while True:
        top, index = probs.topk(k, dim=-1) if k < vocab else probs.sort(dim=-1, descending=True)
        if k == vocab or bool((top.sum(dim=-1) >= top_p).all()):
            return top, index
        k = min(4 * k, vocab)


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First position whose ``cdf`` exceeds ``target`` [B, 1], never past the last position with mass.

    Rounding can put the target at or beyond the total; such a row gets the last token of
    non-zero probability instead of the zero-probability tail.
    """
    pos = torch.searchsorted(cdf, target, right=True)
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)
    return torch.minimum(pos, last).clamp(max=cdf.shape[-1] - 1)  # a NaN row (unchecked) stays in range


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor, check_finite: bool = True) -> torch.Tensor:
    """Per row of (unnormalised) ``probs``, the position where the CDF crosses ``u * total``: [B, 1]."""
    rows, width = probs.shape
    if width <= 4 * CDF_BLOCK:
        cdf = probs.double().cumsum(dim=-1)
        if check_finite:
            _check_finite(cdf[:, -1])
        return _search(cdf, uniforms * cdf[:, -1:])
    blocks = -(-width // CDF_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, blocks * CDF_BLOCK - width)).view(rows, blocks, CDF_BLOCK)
    block_cdf = padded.sum(dim=-1).double().cumsum(dim=-1)
    if check_finite:
        _check_finite(block_cdf[:, -1])
    target = uniforms * block_cdf[:, -1:]
    block = _search(block_cdf, target)
    mass_before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)
    inner = padded[torch.arange(rows, device=probs.device), block[:, 0]].double().cumsum(dim=-1)
    return (block * CDF_BLOCK + _search(inner, (target - mass_before).clamp(min=0))).clamp(max=width - 1)
