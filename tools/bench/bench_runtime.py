"""Overhead of the runtime's WorkerGroup dispatch vs raw torch.distributed.rpc.

Run:  OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tools/bench/bench_runtime.py

Prints, side by side with the raw-RPC baseline:
(a) median and p90 latency of a no-op call fanned out to 1, 2, 4 workers
    (``WorkerGroup`` ONE_TO_ALL vs one ``rpc_async`` per rank);
(b) MB/s moving a 64 MB Batch to one worker (``DP_COMPUTE`` vs ``rpc_sync``
    with the same tensors).
The two variants alternate iteration by iteration so machine noise hits both.
Target: ratio (runtime / raw time) <= 1.3.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

from torchrlhf.data import Batch
from torchrlhf.runtime import Dispatch, Worker, WorkerGroup, launch, register


def _noop() -> None:
    return None


def _consume(tensors: dict[str, torch.Tensor]) -> None:
    return None


class Bench(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.DP_COMPUTE)
    def consume(self, batch: Batch) -> None:
        return None


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _alternate(a, b, iters: int, warmup: int) -> tuple[list[float], list[float]]:
    ta, tb = [], []
    for i in range(warmup + iters):
        for fn, out in ((a, ta), (b, tb)):
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
    return ta, tb


def main(iters: int, mb: int) -> None:
    world = dist.get_world_size()
    print(f"world={world}  torch={torch.__version__}  iters={iters}")
    print("(a) no-op fan-out latency, microseconds")
    cols = ("group p50", "raw p50", "ratio", "group p90", "raw p90", "ratio")
    print(f"{'workers':>8} " + " ".join(f"{c:>{6 if c == 'ratio' else 10}}" for c in cols))
    for k in (1, 2, 4):
        if k > world:
            print(f"{k:>8}  (skipped: world has {world} ranks)")
            continue
        ranks = list(range(k))
        group = WorkerGroup(Bench, ranks=ranks, name=f"noop{k}")
        names = [f"worker{r}" for r in ranks]

        def raw() -> None:
            for f in [rpc.rpc_async(n, _noop) for n in names]:
                f.wait()

        tg, tr = _alternate(group.noop, raw, iters, warmup=20)
        g50, r50, g90, r90 = (1e6 * x for x in (_pct(tg, 0.5), _pct(tr, 0.5), _pct(tg, 0.9), _pct(tr, 0.9)))
        print(f"{k:>8} {g50:>10.0f} {r50:>10.0f} {g50 / r50:>6.2f} {g90:>10.0f} {r90:>10.0f} {g90 / r90:>6.2f}")

    target = 1 if world > 1 else 0
    rows = mb * 1024 * 1024 // 4 // 4096
    batch = Batch({"x": torch.randn(rows, 4096)})
    size_mb = batch["x"].numel() * 4 / 2**20
    group = WorkerGroup(Bench, ranks=[target], name="bulk")

    def raw_bulk() -> None:
        rpc.rpc_sync(f"worker{target}", _consume, args=(dict(batch.tensors),))

    tg, tr = _alternate(lambda: group.consume(batch), raw_bulk, max(3, iters // 20), warmup=2)
    g, r = size_mb / statistics.median(tg), size_mb / statistics.median(tr)
    print(f"(b) {size_mb:.0f} MB Batch to rank {target}, median MB/s")
    print(f"{'DP_COMPUTE':>12} {'rpc_sync':>10} {'ratio (group/raw time)':>24}")
    print(f"{g:>12.0f} {r:>10.0f} {r / g:>24.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--mb", type=int, default=64)
    a = p.parse_args()
    torch.set_num_threads(1)
    launch(main, a.iters, a.mb)
