"""Train→generation weight transition: the hybrid resharder vs the naive full_tensor() baseline.

Run on 4 ranks (gloo, CPU):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tools/bench/bench_reshard.py [--layers 4]

For generation TP 1 and 2 it times, side by side on the same FSDP2-sharded Llama-shaped model:

- hybrid: `torchrlhf.hybrid.iter_generation_weights` (micro-DP all-gather / TP exchange, streamed);
- naive-streamed: per parameter ``p.full_tensor()`` on every rank, then slice to the TP shard;
- naive-materialised: all ``full_tensor()`` first (a full state dict), then slice.

Each consumer copies the yielded tensor into a pre-allocated engine buffer of the generation shape.
Reported per rank (max over ranks for time, rank 0's figures otherwise): wall time (median of
--reps after a warm-up), peak transient bytes (the resharder's counter; the baselines' live full
tensors, counted exactly), bytes received from other ranks, and the lower bound (generation shards
minus what the rank already held).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchrlhf.hybrid import ReshardStats, generation_mesh, iter_generation_weights, suffix_tp_dims
from torchrlhf.models import build_tiny_causal_lm

TP_DIMS = suffix_tp_dims({
    "self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0, "self_attn.v_proj.weight": 0,
    "self_attn.o_proj.weight": 1, "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1,
    "embed_tokens.weight": 0,
})


def tp_slice(full: torch.Tensor, dim: int | None, t: int, i: int) -> torch.Tensor:
    return full if dim is None or t == 1 else torch.chunk(full, t, dim)[i]


def run_hybrid(model, mesh, buffers) -> dict:
    stats = ReshardStats()
    for name, tensor in iter_generation_weights(model, mesh, TP_DIMS, stats=stats):
        buffers[name].copy_(tensor)
    return {"peak": stats.peak_transient_bytes, "received": stats.bytes_received, "lower": stats.lower_bound_bytes}


def run_naive(model, mesh, buffers, materialise: bool) -> dict:
    t, i = mesh.size(1), mesh.get_local_rank("tp")
    peak = received = 0
    with torch.no_grad():
        params = [(n, p) for n, p in model.named_parameters()]
        if materialise:
            fulls = {n: p.full_tensor() for n, p in params}
            peak = sum(f.nbytes for f in fulls.values())
            for n, p in params:
                received += fulls[n].nbytes - p.to_local().nbytes
                buffers[n].copy_(tp_slice(fulls[n], TP_DIMS(n), t, i))
            del fulls
        else:
            for n, p in params:
                full = p.full_tensor()
                peak = max(peak, full.nbytes)
                received += full.nbytes - p.to_local().nbytes
                buffers[n].copy_(tp_slice(full, TP_DIMS(n), t, i))
                del full
    return {"peak": peak, "received": received}


def timed(fn, reps: int) -> tuple[float, dict]:
    fn()  # warm-up
    times, info = [], {}
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        info = fn()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times), info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    model = build_tiny_causal_lm(dict(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
    ), seed=0)
    total = sum(p.nbytes for p in model.parameters())
    largest = max(p.nbytes for p in model.parameters())
    world = init_device_mesh("cpu", (n,))
    for block in model.model.layers:
        fully_shard(block, mesh=world)
    fully_shard(model, mesh=world)
    if rank == 0:
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {total / 2**20:.1f} MiB fp32, "
              f"largest param {largest / 2**20:.2f} MiB; {n} ranks, gloo/CPU")
        print(f"{'gen TP':>6} {'method':<20} {'time s':>8} {'x naive':>8} {'peak extra MiB':>15} "
              f"{'recv MiB':>9} {'lower bd MiB':>13} {'recv/lower':>10}")
    for t in (1, 2):
        mesh = generation_mesh(world, t)
        i = mesh.get_local_rank("tp")
        buffers = {}
        for name, p in model.named_parameters():
            buffers[name] = tp_slice(torch.empty(p.shape), TP_DIMS(name), t, i).clone()
        rows = {
            "hybrid": timed(lambda: run_hybrid(model, mesh, buffers), args.reps),
            "naive-streamed": timed(lambda: run_naive(model, mesh, buffers, False), args.reps),
            "naive-materialised": timed(lambda: run_naive(model, mesh, buffers, True), args.reps),
        }
        slowest = [None] * n
        dist.all_gather_object(slowest, {k: v[0] for k, v in rows.items()})
        if rank == 0:
            lower = rows["hybrid"][1]["lower"]
            base = max(s["naive-streamed"] for s in slowest)
            for method, (_, info) in rows.items():
                sec = max(s[method] for s in slowest)
                print(f"{t:>6} {method:<20} {sec:>8.3f} {base / sec:>7.2f}x {info['peak'] / 2**20:>15.2f} "
                      f"{info['received'] / 2**20:>9.2f} {lower / 2**20:>13.2f} {info['received'] / lower:>10.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
