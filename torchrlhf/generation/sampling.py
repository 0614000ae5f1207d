"""Sampling parameters and the batched token sampler.

Sampling draws one uniform number per (request, step) and inverts the CDF of the
filtered distribution. The uniforms come from a per-request `torch.Generator`
drawn once when the request enters the batch, so a request's samples depend only
on its seed and its own logits, never on which other requests share the batch.
"""

from __future__ import annotations

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
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if any(not s for s in self.stop):
            raise ValueError("SamplingParams.stop must not contain empty strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def request_uniforms(seed: int, sample: int, steps: int) -> torch.Tensor:
    """The ``steps`` uniforms in [0, 1) that sample ``sample`` of a prompt seeded ``seed`` uses."""
    gen = torch.Generator(device="cpu")
    # Mix the two numbers so (seed, sample) pairs of nearby prompts do not collide.
    gen.manual_seed((seed * 1_000_003 + sample * 7919 + 0x9E3779B9) % (2**63))
    return torch.rand(steps, generator=gen, dtype=torch.float64)


def sample_tokens(
    logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V] with the given uniforms [B].

    Returns (tokens [B] long, log-probs [B] float32) where the log-prob is of the
    temperature-scaled distribution before top-k/top-p/min-p filtering (the
    distribution the trainer recomputes).
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)

    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    probs = logp.exp()
    vocab = probs.shape[-1]
    index = None
    if 0 < params.top_k < vocab:
        probs, index = probs.topk(params.top_k, dim=-1)  # sorted, most likely first
    elif params.top_p < 1:
        probs, index = probs.sort(dim=-1, descending=True)
    if params.top_p < 1:
        # Keep a token while the mass before it is below top_p (the top token always stays).
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= params.top_p, 0.0)
    if params.min_p > 0:
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Inverse CDF: the first position whose cumulative mass exceeds u * total.
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    pos = torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1)
    tokens = (index.gather(-1, pos) if index is not None else pos).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
