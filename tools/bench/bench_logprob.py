"""Token log-probs + entropy from hidden states: the fused head vs the textbook dense computation.

The actor's loss needs ``log softmax(h W^T / T)[label]`` with a gradient to ``h`` and ``W``, and the
entropy (a metric, no gradient, unless there is an entropy bonus). The textbook way (``dense``) projects
every position to float32 logits (an [N, V] tensor kept for backward, plus its scaled copy, softmax
temporaries and an [N, V] gradient); `torchrlhf.algorithms.log_probs_from_hidden` projects tiles and
recomputes them in backward: ``rows`` is its schedule with whole-vocabulary tiles ([256, V], 48 MiB for
SmolLM2), ``tiles`` the default ([256, 4096], 4 MiB, folded by online softmax). Each side runs in its own
subprocess (its peak RSS is its own), on the same float32 inputs: N response positions, ``--hidden``-wide
hidden states (SmolLM2's 576 by default) and SmolLM2's 49 152-token vocabulary.

    python tools/bench/bench_logprob.py [--positions 768 --hidden 576 --temperature 1.0 0.7 --entropy-grad]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from torchrlhf.algorithms import log_probs_from_hidden
from torchrlhf.algorithms.logprob import tile_sizes

VOCAB = 49152
SIDES = ("dense", "rows", "tiles")


def step(side: str, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float,
         entropy_grad: bool) -> None:
    if side == "dense":
        z = (hidden @ weight.t()) / temperature
        log_p = torch.log_softmax(z, -1)
        lp = log_p.gather(-1, labels[:, None]).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad):
            p = torch.softmax(z, -1)
            h = -(p * torch.log_softmax(z, -1)).sum(-1)
    else:
        vocab_chunk = {"rows": VOCAB}.get(side, tile_sizes(hidden.device)[1])
        lp, h = log_probs_from_hidden(hidden, weight, labels, temperature, vocab_chunk_size=vocab_chunk)
        h = h if entropy_grad else h.detach()
    loss = lp.sum() + (0.01 * h.sum() if entropy_grad else 0.0)
    loss.backward()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(side: str, args: argparse.Namespace, temperature: float) -> dict:
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.positions, args.hidden, generator=g).requires_grad_()
    weight = (torch.randn(VOCAB, args.hidden, generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, VOCAB, (args.positions,), generator=g)
    weight.grad = torch.zeros_like(weight)  # the parameter's gradient exists in training either way
    base = _rss_mb()  # inputs and the weight gradient allocated; the peak above this is the step's own
    times = []
    for i in range(args.steps + 1):  # the first is a warm-up
        start = time.perf_counter()
        step(side, hidden, weight, labels, temperature, args.entropy_grad)
        if i:
            times.append(time.perf_counter() - start)
        hidden.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"s": statistics.median(times), "peak_over_mb": peak - base}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=768, help="response positions N (e.g. 16 samples x 48)")
    ap.add_argument("--hidden", type=int, default=576, help="hidden size D (the head's weight is [V, D])")
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.7])
    ap.add_argument("--entropy-grad", action="store_true", help="an entropy bonus: the entropy needs a gradient")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # child process: SIDE TEMPERATURE
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], args, float(args.one[1]))))
        return
    logits_mb = args.positions * VOCAB * 4 / 2**20
    print(f"log-probs + entropy{' (with gradient)' if args.entropy_grad else ''} for {args.positions} positions "
          f"x {VOCAB} vocab x {args.hidden} hidden, float32 (dense logits {logits_mb:.0f} MB), forward + backward, "
          f"median of {args.steps}, {args.threads} threads")
    print(f"{'T':>4} {'side':<8} {'s/step':>7} {'vs dense':>9} {'peak MB':>8}")  # peak RSS above the inputs
    for temperature in args.temperature:
        results = {}
        for side in SIDES:
            cmd = [sys.executable, __file__, "--one", side, str(temperature), "--positions", str(args.positions),
                   "--steps", str(args.steps), "--threads", str(args.threads), "--hidden", str(args.hidden)]
            cmd += ["--entropy-grad"] if args.entropy_grad else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            results[side] = json.loads(out.strip().splitlines()[-1])
        for side in SIDES:
            r = results[side]
            print(f"{temperature:>4} {side:<8} {r['s']:>7.3f} {results['dense']['s'] / r['s']:>8.2f}x "
                  f"{r['peak_over_mb']:>8.0f}")


if __name__ == "__main__":
    main()
