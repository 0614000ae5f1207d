"""Milliseconds per decode step of the token sampler vs the textbook one, side by side.

The textbook sampler (this engine's before it was tuned) takes the full-vocabulary
``log_softmax``, sorts the whole vocabulary for top-p (``topk`` for top-k), and
inverts one float64 cumsum over what is left. The
engine's `sample_tokens` uses a softmax, a partial sort (top-p candidates) and a
two-level inverse CDF. Both run on the same random logits ``[batch, vocab]``.

    python tools/bench/bench_sampling.py --batch-sizes 16 64 --vocab 49152 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from torchrlhf.generation import SamplingParams, sample_tokens
from torchrlhf.runtime.launch import _tune_malloc


def textbook_sample(logits: torch.Tensor, uniforms: torch.Tensor, params: SamplingParams):
    logp = torch.log_softmax(logits.float() / params.temperature, dim=-1)
    probs, index = logp.exp(), None
    if params.top_k > 0:
        probs, index = probs.topk(params.top_k, dim=-1)
    elif params.top_p < 1:
        probs, index = probs.sort(dim=-1, descending=True)
    if params.top_p < 1:
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= params.top_p, 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    cdf = probs.double().cumsum(dim=-1)
    pos = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)
    tokens = (index.gather(-1, pos) if index is not None else pos).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def time_ms(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    _tune_malloc()  # as a run's ranks do: without it each call's [batch, vocab] buffers are fresh mmap pages
    torch.set_num_threads(args.threads)
    settings = {
        "temperature 1": SamplingParams(temperature=1.0),
        "top_p 0.9": SamplingParams(temperature=1.0, top_p=0.9),
        "top_k 50": SamplingParams(temperature=1.0, top_k=50),
        "min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
    }
    print(f"vocab {args.vocab}, {args.threads} threads, ms per call")
    print(f"{'batch':>5} {'setting':>14} {'engine ms':>10} {'textbook ms':>12} {'speed-up':>9}")
    for bs in args.batch_sizes:
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(bs, args.vocab, generator=gen) * 3
        uniforms = torch.rand(bs, generator=gen, dtype=torch.float64)
        for name, params in settings.items():
            ours = time_ms(lambda: sample_tokens(logits, uniforms, params), args.repeats)
            base = time_ms(lambda: textbook_sample(logits, uniforms, params), args.repeats)
            print(f"{bs:>5} {name:>14} {ours:>10.2f} {base:>12.2f} {base / ours:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
