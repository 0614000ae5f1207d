"""Where an actor update's time goes: `torch.profiler` over one `ActorWorker.update`, summarised by kind.

The update runs on synthetic GRPO rollouts of a named shape (`bench_train.SHAPES`: ``learn``, the learning
config's; ``gsm8k``, a GSM8K-shaped batch), in ``--dtype`` (bf16 keeps fp32 master weights and computes
with bf16 copies on a one-rank process group, as a one-process recipe run does), dense or shared-prefix. After ``--warmup`` updates one
is profiled (CPU activities, shapes recorded) and every op's self time is put in one row:

- GEMMs (``mm``/``addmm``/``bmm``...), with their FLOPs from the recorded shapes and the rate they ran at,
  split into the LM head's (forward, its backward and the backward's recompute) and the rest;
- attention kernels (SDPA forward/backward) and their number of calls;
- the head's other ops (the tiled log-softmax), the optimizer, FSDP2's gathers/casts/reductions,
  dtype casts and copies elsewhere, the embedding's backward, other elementwise ops;
- with ``--compile``, the compiled blocks' own code: inductor's fused kernels run inside the compiled graph's
  call, not as ``aten`` ops;
- autograd's own bookkeeping (self time of its nodes) and time in no op at all (Python, the profiler).

Then the ten costliest GEMM shapes. Profiling adds overhead to every op: compare the profiled step time with
the unprofiled one printed above it, and read the table as shares.

    python tools/bench/profile_update.py --shape learn --dtype float32 --side shared [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import SHAPES, actor_step, group_rollouts, shape_batch  # noqa: E402

from torchrlhf.models import smollm2_model_dir  # noqa: E402
from torchrlhf.runtime.launch import _tune_malloc  # noqa: E402

GEMMS = {"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
CASTS = {"aten::to", "aten::_to_copy", "aten::copy_", "aten::clone", "aten::contiguous"}


def gemm_flops(name: str, shapes: list) -> float:
    """2 M K N (× batch) from a GEMM op's recorded input shapes."""
    try:
        if name in ("aten::mm",):
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2.0 * m * k * n
        if name in ("aten::addmm", "aten::addmm_", "aten::_addmm_activation"):
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2.0 * m * k * n
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = shapes[0], shapes[1]
            return 2.0 * b * m * k * n
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = shapes[1], shapes[2]
            return 2.0 * b * m * k * n
    except (ValueError, IndexError, TypeError):
        pass
    return 0.0


def _ancestors(event) -> list[str]:
    names, e = [], event.cpu_parent
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    return names


def category(event) -> str:
    """The row an op's self time goes to (see the module docstring)."""
    name, up = event.name, _ancestors(event)
    in_head = any("_FusedLogProb" in a for a in up) or "_FusedLogProb" in name
    if name in GEMMS:
        return "GEMM: LM head (fwd, bwd, recompute)" if in_head else "GEMM: blocks"
    if name.startswith("aten::_scaled_dot_product") or name.startswith("aten::_flash_attention"):
        return "attention kernels (SDPA)"
    if in_head:
        return "head: tiled log-softmax (non-GEMM)"
    if any(a.startswith("Optimizer.") for a in up) or name.startswith("Optimizer."):
        return "optimizer step / zero_grad"
    if any(a.startswith("FSDP::") for a in up) or name.startswith("FSDP::"):
        return "FSDP2: gathers, casts, grad reductions"
    if name.startswith("autograd::engine::evaluate_function") or name.endswith("Backward0") \
            or name.endswith("Backward1") or name == "torch::autograd::AccumulateGrad":
        return "autograd node bookkeeping"
    if name == "aten::embedding_dense_backward" or any(a == "aten::embedding_dense_backward" for a in up):
        return "embedding backward (dense [V, D] grad)"
    if name in CASTS:
        return "casts and copies"
    if name.startswith("aten::"):
        return "other ops (norms, RoPE, SiLU, residuals, masks...)"
    if "CompiledFxGraph" in name or name.startswith(("Torch-Compiled Region", "CompiledFunction")):
        return "compiled blocks (inductor's fused kernels)"
    return "Python inside ranges"


def summarise(prof, wall_s: float) -> str:
    rows: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    shapes: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    sdpa_calls, phases = 0, defaultdict(float)
    for e in prof.events():
        self_s = e.self_cpu_time_total / 1e6
        cat = category(e)
        rows[cat] += self_s
        up = _ancestors(e)
        phase = "optimizer" if any(a.startswith("Optimizer.") for a in up + [e.name]) else \
            "backward" if any(a.startswith("autograd::engine") for a in up + [e.name]) else "forward / other"
        phases[phase] += self_s
        if e.name in GEMMS:
            f = gemm_flops(e.name, e.input_shapes)
            flops[cat] += f
            key = (e.name, str(e.input_shapes[:3]))
            shapes[key][0] += 1
            shapes[key][1] += self_s
            shapes[key][2] += f
        if e.name.startswith("aten::_scaled_dot_product") and "backward" not in e.name:
            sdpa_calls += 1
    in_ops = sum(rows.values())
    rows["outside any op (Python, profiler)"] = max(wall_s - in_ops, 0.0)
    out = [f"{'where':<48} {'s':>8} {'share':>7} {'GFLOP':>8} {'GFLOP/s':>8}"]
    for cat, s in sorted(rows.items(), key=lambda kv: -kv[1]):
        f = flops.get(cat, 0.0)
        rate = f"{f / s / 1e9:8.1f}" if f and s else f"{'':>8}"
        gf = f"{f / 1e9:8.1f}" if f else f"{'':>8}"
        out.append(f"{cat:<48} {s:8.2f} {100 * s / wall_s:6.1f}% {gf} {rate}")
    total_f = sum(flops.values())
    out.append(f"{'profiled step':<48} {wall_s:8.2f} {100.0:6.1f}% {total_f / 1e9:8.1f} {total_f / wall_s / 1e9:8.1f}")
    out.append(f"SDPA forward calls: {sdpa_calls}; phases (self time): "
               + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()))
    out.append("")
    out.append(f"{'costliest GEMMs (op, input shapes)':<72} {'calls':>6} {'s':>7} {'GFLOP/s':>8}")
    for (name, shp), (calls, s, f) in sorted(shapes.items(), key=lambda kv: -kv[1][1])[:10]:
        out.append(f"{name.removeprefix('aten::') + ' ' + shp:<72} {calls:>6} {s:7.2f} {f / s / 1e9 if s else 0:8.1f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="learn")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--side", choices=["dense", "shared"], default="shared")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (all-linear); 0 trains every weight")
    ap.add_argument("--warmup", type=int, default=2, help="unprofiled updates first (the last one is timed)")
    ap.add_argument("--compile", action="store_true", help="compile each block (``actor.compile``)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    _tune_malloc()  # glibc's malloc keeps freed memory, as on every rank of a run
    shape = SHAPES[args.shape]
    batch = group_rollouts(**shape_batch(shape), vocab=49152)
    step = actor_step(str(smollm2_model_dir()), batch, shape["micro"], shared=args.side == "shared", dtype=args.dtype,
                      lora_rank=args.lora, compile=args.compile)
    times = []
    for _ in range(args.warmup):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    print(f"profile_update: shape {args.shape} ({shape}), {args.dtype}, {args.side}, lora rank {args.lora}, "
          f"{'compiled' if args.compile else 'eager'}, {args.threads} threads, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"unprofiled update: {times[-1]:.2f} s (warm-up updates: {[round(t, 2) for t in times]}); "
          f"profiled: {wall:.2f} s; median of all: {statistics.median(times + [wall]):.2f} s")
    print(summarise(prof, wall))


if __name__ == "__main__":
    main()
