"""Actor update time and peak memory: a plain HF loop vs `ActorWorker.update` dense vs shared-prefix.

Synthetic GRPO rollouts on SmolLM2-135M (fp32, CPU): ``--prompts`` groups of n
samples sharing one ``--prompt-len``-token prompt, responses of ``--response-len/2``
to ``--response-len`` tokens, for each group size in ``--n``. Three sides train on
the same batch, one optimizer step per update, micro-batches of ``--micro`` samples:

- ``plain HF``: the textbook loop (padded rows, logits at every position, full log-softmax);
- ``dense``: ``ActorWorker(shared_prefix=False)`` (padding columns trimmed, the head scoring
  response positions only, fused with the log-softmax: no logits);
- ``shared``: ``ActorWorker(shared_prefix=True)`` (each prompt once, packed suffixes, the same head).

Each (side, n) runs in its own subprocess, so its peak RSS above the loaded model is
its own. Tokens computed per step are printed beside the ideal shared/dense ratio
n(P+R) / (P+nR) (P, R: mean prompt and response tokens).

    python tools/bench/bench_train.py [--n 4 8 16 --prompts 2 --prompt-len 150 --response-len 48 --steps 3]

``--mfu``: the update's model FLOPs utilisation instead, dense and shared, for each of ``--shapes``
(`SHAPES`: the learning config's update and a GSM8K-shaped one) and ``--dtypes`` (bf16: fp32 master
weights and bf16 compute, as a one-process recipe run holds them: `models.parallelize.model_layout`). Per row: seconds per update (median of
``--steps`` after one warm-up), the main thread's CPU seconds (close to the wall time when no other
process took the cores), model FLOPs (`torchrlhf.utils.flops`: fwd + bwd of the tokens processed), the
achieved GFLOP/s, the matmul peak of the dtype at ``--threads`` threads (`utils.flops.matmul_peak`,
measured before and after the rows: the spread says how quiet the host was), MFU, the process's peak RSS
and its rise over the built model. With ``--baseline DIR`` (another checkout of the library, e.g. an
export of an older commit) every row also runs that code, interleaved, and prints after/before:

    python tools/bench/bench_train.py --mfu --threads 2 --baseline /tmp/base [--shapes learn gsm8k] [--compile]

``--offload``: the traced peak of one shared-prefix mini-batch, without and with
``actor.memory.offload_prefix_activations`` (fake tensors: no time, no host load), per shape and dtype:

    python tools/bench/bench_train.py --offload --shapes gsm8k --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import torchrlhf
from torchrlhf.data import Batch
from torchrlhf.models import build_meta_causal_lm, load_causal_lm, smollm2_model_dir
from torchrlhf.runtime.launch import _tune_malloc
from torchrlhf.utils.flops import TransformerFlops, matmul_peak
from torchrlhf.workers import ActorWorker, Batching
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, forward_counts

SIDES = ("plain HF", "dense", "shared")


def group_rollouts(prompts: int, n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> Batch:
    """``prompts`` groups of ``n`` samples; a group shares its prompt (exactly ``prompt_len`` tokens)."""
    g = torch.Generator().manual_seed(seed)
    b = prompts * n
    prompt = torch.randint(10, vocab, (prompts, prompt_len), generator=g).repeat_interleave(n, 0)
    r_lens = torch.randint(response_len // 2, response_len + 1, (b,), generator=g)
    r_mask = (torch.arange(response_len) < r_lens[:, None]).long()
    responses = torch.randint(10, vocab, (b, response_len), generator=g) * r_mask
    mask = torch.cat([torch.ones(b, prompt_len, dtype=torch.long), r_mask], 1)
    return Batch(
        {
            "prompts": prompt,
            "responses": responses,
            "input_ids": torch.cat([prompt, responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": r_mask,
            "old_log_probs": torch.full((b, response_len), -5.0) * r_mask,
            "advantages": torch.randn(b, response_len, generator=g) * r_mask,
        },
    )


# Update shapes for ``--mfu`` and `profile_update.py`: 8 prompts x 8 samples; responses of
# response_len/2..response_len tokens (mean 3/4 of it); micro-batches as their recipe configs.
SHAPES = {
    "learn": dict(prompts=8, n=8, prompt_len=40, response_len=19, micro=32),  # grpo_arithmetic_learn.yaml
    "gsm8k": dict(prompts=8, n=8, prompt_len=150, response_len=64, micro=8),  # GSM8K-shaped
}


def shape_batch(shape: dict) -> dict:
    """`group_rollouts` arguments of a `SHAPES` entry."""
    return {k: shape[k] for k in ("prompts", "n", "prompt_len", "response_len")}


def one_rank_group() -> None:
    """A one-rank gloo process group, as a one-process recipe run has (with it a bf16 actor holds fp32 master
    weights and bf16 compute copies, as in training; an fp32 one stays a plain module)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def actor_step(path: str, batch: Batch, micro: int, shared: bool, dtype: str = "float32", lora_rank: int = 0,
               compile: bool = False) -> Callable[[], dict[str, float]]:
    """One `ActorWorker.update` over ``batch`` (one optimizer step, micro-batches of ``micro`` samples);
    ``lora_rank`` > 0 trains all-linear LoRA adapters of that rank instead of every weight; ``compile``
    compiles each block (``actor.compile``)."""
    one_rank_group()
    lora = {"rank": lora_rank, "alpha": 2 * lora_rank} if lora_rank else None
    actor = ActorWorker(path, optim={"lr": 1e-6}, shared_prefix=shared, dtype=dtype, lora=lora,
                        compile=compile,
                        batching=Batching(ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_device=micro))
    return lambda: actor.update(batch, temperature=1.0)


def plain_hf_step(path: str, batch: Batch, micro: int) -> Callable[[], None]:
    """The textbook loop: full padded micro-batches, logits for every position, PPO token-mean loss."""
    model = load_causal_lm(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    r = batch["responses"].shape[1]
    total_tokens = batch["response_mask"].sum()

    def step() -> None:
        for mb in batch.split(micro):
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                           position_ids=mb["position_ids"], use_cache=False).logits[:, -r - 1 : -1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb["responses"][..., None]).squeeze(-1)
            ratio = torch.exp(lp - mb["old_log_probs"])
            loss = -(mb["advantages"] * ratio.clamp(0.8, 1.2) * mb["response_mask"]).sum() / total_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(side: str, n: int, args: argparse.Namespace) -> dict:
    """One side, one group size, in this process: seconds per update and peak RSS above the loaded state."""
    torch.set_num_threads(args.threads)
    path = str(smollm2_model_dir())
    batch = group_rollouts(args.prompts, n, args.prompt_len, args.response_len, 49152)
    if side == "plain HF":
        step = plain_hf_step(path, batch, args.micro)
    else:
        step = actor_step(path, batch, args.micro, shared=side == "shared")
    step()  # warm-up (also allocates the optimizer state)
    base = _rss_mb()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"s": statistics.median(times), "peak_over_mb": max(peak - base, 0.0), "all": times}


def measure_mfu(shape_name: str, dtype: str, side: str, args: argparse.Namespace) -> dict:
    """One ``--mfu`` row in this process (whichever library is on the path): seconds and memory per update."""
    _tune_malloc()  # glibc's malloc keeps freed memory, as on every rank of a run
    torch.set_num_threads(args.threads)
    shape = SHAPES[shape_name]
    batch = group_rollouts(**shape_batch(shape), vocab=49152)
    step = actor_step(str(smollm2_model_dir()), batch, shape["micro"], shared=side == "shared", dtype=dtype,
                      compile=args.compile)
    built = _rss_mb()
    for _ in range(2 if args.compile else 1):  # warm-up (also allocates the optimizer state; compiles)
        step()
    wall, cpu = [], []
    for _ in range(args.steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"s": statistics.median(wall), "cpu_s": statistics.median(cpu), "all": wall, "peak_mb": peak,
            "over_mb": peak - built, "library": os.path.dirname(torchrlhf.__file__)}


def update_flops(shape_name: str, shared: bool) -> int:
    """Model FLOPs of one update of ``shape_name``'s batch (forward + backward, `torchrlhf.utils.flops`)."""
    batch = group_rollouts(**shape_batch(SHAPES[shape_name]), vocab=49152)
    counts = forward_counts(batch, SharedPrefixPlan(batch) if shared else None)
    return TransformerFlops.from_model(build_meta_causal_lm(str(smollm2_model_dir()))).train(*counts)


def _host() -> str:
    model, flags = "", set()
    if os.path.exists("/proc/cpuinfo"):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model or platform.processor()} ({', '.join(isa) or 'no AVX2'}), {os.cpu_count()} CPUs"


def mfu_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    codes = [("before", args.baseline), ("after", None)] if args.baseline else [("after", None)]
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    peaks = {d: [matmul_peak(getattr(torch, d), torch.device("cpu"), min_seconds=1.0)] for d in args.dtypes}
    print(f"actor update MFU{' (blocks compiled)' if args.compile else ''}: SmolLM2-135M, {args.threads} threads, {_host()}, torch {torch.__version__}, median of "
          f"{args.steps} updates after a warm-up; matmul peak GFLOP/s (before the rows): "
          + ", ".join(f"{d} {v[0] / 1e9:.1f}" for d, v in peaks.items()))
    print(f"{'shape':<6} {'dtype':<9} {'side':<7} {'code':<7} {'s/update':>9} {'cpu s':>7} {'GFLOP':>7} "
          f"{'GFLOP/s':>8} {'MFU':>6} {'peak MB':>8} {'+MB':>6} {'after/before':>12}")
    for shape_name in args.shapes:
        for dtype in args.dtypes:
            for side in ("dense", "shared"):
                flops = update_flops(shape_name, side == "shared")
                res = {}
                for code, path in codes:
                    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
                           "PYTHONPATH": os.pathsep.join(filter(None, [path or here, os.environ.get("PYTHONPATH")]))}
                    cmd = [sys.executable, __file__, "--steps", str(args.steps), "--threads", str(args.threads),
                           "--mfu-one", shape_name, dtype, side] + (["--compile"] if args.compile else [])
                    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                    if proc.returncode != 0:
                        raise SystemExit(f"{shape_name} {dtype} {side} ({code}) failed:\n{proc.stderr[-3000:]}")
                    res[code] = json.loads(next(ln for ln in proc.stdout.splitlines()
                                                if ln.startswith("RESULT")).split(" ", 1)[1])
                for code, r in res.items():
                    rate = flops / r["s"]
                    ratio = f"{res['before']['s'] / r['s']:11.2f}x" if code == "after" and "before" in res else ""
                    print(f"{shape_name:<6} {dtype:<9} {side:<7} {code:<7} {r['s']:9.2f} {r['cpu_s']:7.2f} "
                          f"{flops / 1e9:7.0f} {rate / 1e9:8.1f} {rate / peaks[dtype][0]:6.1%} {r['peak_mb']:8.0f} "
                          f"{r['over_mb']:6.0f} {ratio:>12}", flush=True)
    for d in args.dtypes:
        peaks[d].append(matmul_peak(getattr(torch, d), torch.device("cpu"), min_seconds=1.0))
    print("matmul peak GFLOP/s before / after the rows: "
          + ", ".join(f"{d} {v[0] / 1e9:.1f} / {v[1] / 1e9:.1f}" for d, v in peaks.items()))


def offload_main(args: argparse.Namespace) -> None:
    """The traced peak of one shared-prefix mini-batch per shape and dtype, with and without
    ``offload_prefix_activations`` (`trainer.memory.trace_shared_prefix_update`: fake tensors, one rank,
    unsharded; every response at its longest)."""
    from torchrlhf.trainer.memory import trace_shared_prefix_update

    path = str(smollm2_model_dir())
    print("shared-prefix update, traced peak per rank (SmolLM2-135M, unsharded, responses at their longest), MiB")
    print(f"{'shape':<6} {'dtype':<9} {'offload':<8} {'activations':>11} {'temporaries':>11} {'states':>8} "
          f"{'peak':>8} {'host':>8} {'peak cut':>8}")
    for shape_name in args.shapes:
        shape = SHAPES[shape_name]
        for dtype in args.dtypes:
            peaks = {}
            for offload in (False, True):
                traced = trace_shared_prefix_update(
                    path, dtype=getattr(torch, dtype), prompts=shape["prompts"], n=shape["n"], micro=shape["micro"],
                    prompt_len=shape["prompt_len"], response_len=shape["response_len"], offload=offload)
                host = traced.pop("offloaded")
                states = sum(traced.get(k, 0) for k in ("parameters", "gradients", "optimizer states", "buffers"))
                peaks[offload] = sum(traced.values())
                cut = f"{1 - peaks[True] / peaks[False]:8.1%}" if offload else ""
                mib = 2 ** 20
                print(f"{shape_name:<6} {dtype:<9} {str(offload):<8} {traced.get('activations', 0) / mib:11.0f} "
                      f"{traced.get('temporaries', 0) / mib:11.0f} {states / mib:8.0f} {peaks[offload] / mib:8.0f} "
                      f"{host / mib:8.0f} {cut:>8}", flush=True)


def token_counts(n: int, args: argparse.Namespace) -> dict[str, float]:
    batch = group_rollouts(args.prompts, n, args.prompt_len, args.response_len, 49152)
    plan = SharedPrefixPlan(batch)
    p = float(args.prompt_len)
    r = batch["response_mask"].sum().item() / len(batch)
    return {
        "padded": batch["input_ids"].numel(),
        "dense": int(batch["attention_mask"].sum()),
        "shared": plan.prefix_tokens() + plan.suffix_tokens(),
        "ideal": n * (p + r) / (p + n * r),
        "R": r,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[4, 8, 16], help="group sizes")
    ap.add_argument("--prompts", type=int, default=2, help="groups (prompts) per update")
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--micro", type=int, default=4, help="samples per micro-batch (all sides)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    ap.add_argument("--mfu", action="store_true", help="MFU of the update per shape, dtype and side (see above)")
    ap.add_argument("--offload", action="store_true", help="the traced peak of a shared-prefix update per shape "
                    "and dtype, with and without offload_prefix_activations")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), help="with --mfu, --offload")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                    help="with --mfu")
    ap.add_argument("--compile", action="store_true", help="with --mfu: each block compiled (actor.compile; two "
                    "warm-up updates)")
    ap.add_argument("--baseline", help="with --mfu: a checkout of the library to run side by side ('before')")
    ap.add_argument("--one", nargs=2, metavar=("SIDE", "N"), help=argparse.SUPPRESS)  # child process
    ap.add_argument("--mfu-one", nargs=3, metavar=("SHAPE", "DTYPE", "SIDE"), help=argparse.SUPPRESS)  # child
    args = ap.parse_args()
    if args.one:
        print("RESULT", json.dumps(measure(args.one[0], int(args.one[1]), args)))
        return
    if args.mfu_one:
        print("RESULT", json.dumps(measure_mfu(*args.mfu_one, args)))
        return
    if args.mfu:
        mfu_main(args)
        return
    if args.offload:
        offload_main(args)
        return

    print(f"SmolLM2-135M fp32 actor update, {args.prompts} prompts x n, prompt {args.prompt_len} tokens, response "
          f"{args.response_len // 2}-{args.response_len}, micro-batch {args.micro} samples, median of {args.steps} "
          f"steps, {args.threads} threads, {os.cpu_count()} CPUs")
    print(f"{'n':>3} {'side':<9} {'tokens':>7} {'s/update':>9} {'vs dense':>9} {'vs HF':>7} {'peak MB':>8}")
    base_cmd = [sys.executable, __file__, "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len),
                "--response-len", str(args.response_len), "--micro", str(args.micro), "--steps", str(args.steps),
                "--threads", str(args.threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for n in args.n:
        counts = token_counts(n, args)
        res = {}
        for side in args.sides:
            proc = subprocess.run([*base_cmd, "--one", side, str(n)], capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"{side} n={n} failed:\n{proc.stderr[-3000:]}")
            line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))
            res[side] = json.loads(line.split(" ", 1)[1])
        for side, r in res.items():
            tokens = counts["padded"] if side == "plain HF" else counts[side]
            vs_dense = res["dense"]["s"] / r["s"] if "dense" in res else float("nan")
            vs_hf = res["plain HF"]["s"] / r["s"] if "plain HF" in res else float("nan")
            print(f"{n:>3} {side:<9} {tokens:>7} {r['s']:>9.2f} {vs_dense:>8.2f}x {vs_hf:>6.2f}x "
                  f"{r['peak_over_mb']:>8.0f}")
        print(f"    tokens dense/shared {counts['dense'] / counts['shared']:.2f}x; ideal n(P+R)/(P+nR) = "
              f"{counts['ideal']:.2f}x (P={args.prompt_len}, R={counts['R']:.1f})")


if __name__ == "__main__":
    main()
