"""CPU attention in bf16 vs fp32: why `models.packed_attention.sdpa` computes bf16 attention in fp32 on a CPU.

Times ``F.scaled_dot_product_attention`` forward + backward at the shapes the library runs (SmolLM2-135M:
9 query heads, 3 KV heads, head dim 64): the packed suffix pass of the learning config (32 samples of ~19
tokens reading 40 prompt tokens), its prompt pass (8 prompts of 40), a GSM8K-shaped suffix pass (8 samples of
64 reading 150 prompt tokens), each under a block mask as `PackedAttention` builds, and a dense causal
micro-batch. Three ways: fp32 inputs, bf16 inputs to the bf16 kernel, bf16 inputs upcast to fp32 and the
output cast back (what `sdpa` does). The ratio bf16 / upcast is the time the upcast saves.

    python tools/bench/bench_attention.py [--threads 2 --iters 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (segments, query length, key length, causal dense)
    "learn suffix (32 x 19 | 40 prompt)": (32, 19, 59, False),
    "learn prompts (8 x 40)": (8, 40, 40, False),
    "gsm8k suffix (8 x 64 | 150 prompt)": (8, 64, 214, False),
    "dense causal (8 x 214)": (8, 214, 214, True),
}


def time_attention(dtype: torch.dtype, upcast: bool, s: int, lq: int, lk: int, causal: bool, iters: int) -> float:
    """Median milliseconds of one forward + backward."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s, 9, lq, 64, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(s, 3, lk, 64, generator=g).to(dtype).requires_grad_() for _ in range(2))
    mask = None if causal else (torch.rand(s, 1, lq, lk, generator=g) > 0.3) | (torch.arange(lk) == 0)
    grad = torch.randn(s, 9, lq, 64, generator=g).to(dtype)

    def step() -> None:
        args = (q.float(), k.float(), v.float()) if upcast else (q, k, v)
        out = F.scaled_dot_product_attention(*args, attn_mask=mask, is_causal=causal, enable_gqa=True)
        out.to(dtype).backward(grad)

    for _ in range(3):
        step()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"SDPA forward + backward, ms (median of {args.iters}), {args.threads} threads, torch {torch.__version__}")
    print(f"{'shape':<38} {'fp32':>7} {'bf16':>7} {'bf16 in fp32':>12} {'bf16 / upcast':>13}")
    for name, shape in SHAPES.items():
        fp32 = time_attention(torch.float32, False, *shape, args.iters)
        bf16 = time_attention(torch.bfloat16, False, *shape, args.iters)
        up = time_attention(torch.bfloat16, True, *shape, args.iters)
        print(f"{name:<38} {fp32:7.2f} {bf16:7.2f} {up:12.2f} {bf16 / up:12.2f}x", flush=True)


if __name__ == "__main__":
    main()
