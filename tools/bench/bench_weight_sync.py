"""Seconds and bytes of one weight update into the rollout engine: colocated (reshard) vs split (broadcast).

SmolLM2-135M (fp32) on 4 CPU ranks (gloo):

* colocated: the actor is FSDP2-sharded over all 4 ranks; `hybrid.generation_mode` streams its shards into
  a released `NativeEngine` on every rank (generation TP 1: each rank gathers the full weights);
* split: the actor is FSDP2-sharded over ranks 0-1, the engines live on ranks 2-3; `hybrid.broadcast`
  gathers full tensors in the actor group and rank 0 broadcasts them bucket by bucket to ranks 2-3.

Each is compared with its bytes over the bandwidth gloo reaches here on a plain collective of the same
kind and size (a 64 MiB all-gather over 4 ranks; a 64 MiB broadcast from rank 0 to ranks 2-3): the
time the bytes alone need.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=4 tools/bench/bench_weight_sync.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchrlhf.generation import NativeEngine
from torchrlhf.hybrid import generation_mode
from torchrlhf.hybrid.broadcast import receive_weights, send_weights, weight_manifest
from torchrlhf.models import load_causal_lm, smollm2_model_dir
from torchrlhf.models.parallelize import parallelize

BUCKET = 64 << 20


def fsdp(model: torch.nn.Module, group: dist.ProcessGroup) -> torch.nn.Module:
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("dp",))
    return parallelize(model, dp_mesh=mesh, tp_mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)


def collective_bandwidth(kind: str, group, ranks: list[int], nbytes: int = 64 << 20) -> float:
    """Bytes/s that one rank receives in a plain gloo collective of ``kind`` (best of 3)."""
    best = 0.0
    for _ in range(3):
        if kind == "all_gather":
            parts = [torch.empty(nbytes // 4 // len(ranks)) for _ in ranks]
            mine = torch.randn(nbytes // 4 // len(ranks))
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_gather(parts, mine, group=group)
            received = nbytes * (len(ranks) - 1) // len(ranks)
        else:
            buf = torch.randn(nbytes // 4)
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.broadcast(buf, src=ranks[0], group=group)
            received = nbytes
        best = max(best, received / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="HF model dir (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("run with torchrun --nproc_per_node=4")
    torch.set_num_threads(1)
    path = args.model or str(smollm2_model_dir())
    model = load_causal_lm(path, dtype=torch.float32)
    manifest = weight_manifest(model)
    total = sum(p.numel() * 4 for p in model.parameters())

    # colocated: every rank trains (FSDP over 4) and generates (TP 1)
    everyone = dist.new_group([0, 1, 2, 3])
    actor = fsdp(load_causal_lm(path, dtype=torch.float32), everyone)
    engine = NativeEngine(path, max_batch_size=1, max_seq_len=64)
    engine.release()
    colocated = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        with generation_mode(actor, engine) as stats:
            pass
        colocated.append((time.perf_counter() - start, stats.bytes_received))
    gather_bw = collective_bandwidth("all_gather", everyone, [0, 1, 2, 3])
    del actor, engine

    # split: actor on 0-1, engines on 2-3, sync group {0, 2, 3}
    actor_ranks, rollout_ranks, sync_ranks = [0, 1], [2, 3], [0, 2, 3]
    sync_group = dist.new_group(sync_ranks)
    actor_group = dist.new_group(actor_ranks)  # every rank takes part in creating a group (gloo naming)
    actor = fsdp(model, actor_group) if rank in actor_ranks else None
    engine = NativeEngine(path, max_batch_size=1, max_seq_len=64) if rank in rollout_ranks else None
    split = []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        if rank in actor_ranks:
            stats = send_weights(actor, sync_group if rank == 0 else None, 0, manifest, torch.float32, BUCKET)
        else:
            stats = receive_weights(engine, sync_group, 0, manifest, torch.float32, BUCKET)
        dist.barrier()
        split.append((time.perf_counter() - start, stats.bytes))
    bcast_bw = collective_bandwidth("broadcast", sync_group, sync_ranks) if rank in sync_ranks else 0.0

    results = [None] * world
    dist.all_gather_object(results, {"colocated": min(colocated), "split": min(split), "gather_bw": gather_bw,
                                     "bcast_bw": bcast_bw})
    if rank == 0:
        mib = 1 << 20
        co_s = max(r["colocated"][0] for r in results)
        co_bytes = results[0]["colocated"][1]
        bw = min(r["gather_bw"] for r in results)
        print(f"SmolLM2-135M fp32, {total / mib:.0f} MiB of weights, 4 CPU ranks (gloo), best of {args.repeats}")
        print(f"{'placement':<10} {'seconds':>8} {'MiB in/rank':>12} {'gloo MB/s':>10} {'bytes/bw s':>11} {'ratio':>6}")
        floor = co_bytes / bw
        print(f"{'colocated':<10} {co_s:>8.3f} {co_bytes / mib:>12.0f} {bw / 1e6:>10.0f} {floor:>11.3f} "
              f"{co_s / floor:>6.2f}")
        sp_s = max(r["split"][0] for r in results)
        sp_bytes = results[2]["split"][1]
        bw = min(results[r]["bcast_bw"] for r in rollout_ranks)
        floor = sp_bytes / bw
        print(f"{'split':<10} {sp_s:>8.3f} {sp_bytes / mib:>12.0f} {bw / 1e6:>10.0f} {floor:>11.3f} "
              f"{sp_s / floor:>6.2f}")
        print("(colocated: each rank receives the 3/4 of the weights it does not hold; split: each rollout rank "
              "receives all of them; 'bytes/bw s' = those bytes at the bandwidth of a plain gloo collective)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
