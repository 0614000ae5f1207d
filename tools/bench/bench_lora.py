"""LoRA against full fine-tuning on SmolLM2-135M: the actor update, the whole GRPO step, the weight-sync bytes.

Three measurements, each side in a process of its own (its peak RSS is its own):

* ``update``: one process holding what a colocated rank holds
  for the actor and the reference. ``full``: a full fine-tuning `ActorWorker` plus the frozen reference
  `ActorWorker`; ``lora-R``: one LoRA `ActorWorker` (rank R, alpha 2R, all-linear) that serves the reference
  itself. Per step: the reference log-probs, then one update (KL loss on). Prints seconds per update and per
  reference pass (median), trainable parameters, and the process's peak RSS (the whole process: weights,
  gradients, optimizer state, activations).
* ``time``: the same updates, full and every LoRA rank alternated in one process, so that a noisy host
  slows every side alike; prints each side's median seconds per update and its ratio to full (the figure
  to quote for speed; ``update``'s sides run one after another and differ by the host's drift).
* ``step``: the recipe ``recipes/configs/grpo_arithmetic_cpu.yaml`` under torchrun (2 ranks, colocated:
  actor, reference and rollout on every rank) with and without ``actor.lora``; the median ``timing_s/step``,
  its update / ref / generation phases, and rank 0's peak RSS (``perf/max_memory_allocated_gb``).
* ``sync``: the same recipe in split placement (actor on rank 0, rollout on rank 1): ``weight_sync/bytes``
  per step, full weights against LoRA ranks.

    python tools/bench/bench_lora.py update [--ranks 8 64 --n 8 --prompts 2 --steps 3]
    python tools/bench/bench_lora.py time [--ranks 8 --steps 5]
    python tools/bench/bench_lora.py step [--ranks 8 --steps 4]
    python tools/bench/bench_lora.py sync [--ranks 8 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import group_rollouts  # noqa: E402

from torchrlhf.models import smollm2_model_dir  # noqa: E402
from torchrlhf.utils.logging import read_metrics  # noqa: E402
from torchrlhf.workers import ActorWorker, Batching  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "recipes", "configs", "grpo_arithmetic_cpu.yaml")


def lora_overrides(rank: int) -> list[str]:
    return [f"actor.lora.rank={rank}", f"actor.lora.alpha={2 * rank}", "actor.lora.target_modules=all-linear"]


def sides(ranks: list[int]) -> list[str]:
    return ["full", *(f"lora-{r}" for r in ranks)]


# ---------------------------------------------------------------------- update
def measure_update(side: str, args: argparse.Namespace) -> dict:
    """One side in this process: seconds per reference pass and per update, peak RSS, trainable parameters."""
    torch.set_num_threads(args.threads)
    path = str(smollm2_model_dir())
    batch = group_rollouts(args.prompts, args.n, args.prompt_len, args.response_len, 49152)
    batching = Batching(ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_device=args.micro)
    common = dict(batching=batching, loss={"use_kl_loss": True})
    if side == "full":
        actor = ActorWorker(path, optim={"lr": 1e-6}, **common)
        ref = ActorWorker(path, batching=batching, freeze=True)
    else:
        rank = int(side.split("-")[1])
        actor = ref = ActorWorker(path, optim={"lr": 1e-5}, lora={"rank": rank, "alpha": 2 * rank}, **common)
    trainable = sum(p.numel() for p in actor.model.parameters() if p.requires_grad)
    ref_s, update_s = [], []
    for step in range(args.steps + 1):  # the first step warms up (and allocates the optimizer state)
        start = time.perf_counter()
        batch = batch.union(ref.compute_ref_log_prob(batch, temperature=1.0))
        mid = time.perf_counter()
        actor.update(batch, temperature=1.0)
        if step:
            ref_s.append(mid - start)
            update_s.append(time.perf_counter() - mid)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"update_s": statistics.median(update_s), "ref_s": statistics.median(ref_s), "peak_mb": peak_mb,
            "trainable": trainable, "all_update_s": update_s}


def update_main(args: argparse.Namespace) -> None:
    print(f"SmolLM2-135M fp32 actor + reference, {args.prompts} prompts x n {args.n}, prompt {args.prompt_len} "
          f"tokens, response {args.response_len // 2}-{args.response_len}, micro-batch {args.micro}, KL loss on, "
          f"median of {args.steps} steps, {args.threads} threads, {os.cpu_count()} CPUs")
    print(f"{'side':<8} {'trainable':>10} {'s/update':>9} {'vs full':>8} {'s/ref':>7} {'peak RSS MB':>12} {'vs full':>8}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    results = {}
    for side in sides(args.ranks):
        cmd = [sys.executable, os.path.abspath(__file__), "update", "--one", side, "--n", str(args.n),
               "--prompts", str(args.prompts), "--prompt-len", str(args.prompt_len), "--response-len",
               str(args.response_len), "--micro", str(args.micro), "--steps", str(args.steps), "--threads",
               str(args.threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{side} failed:\n{proc.stderr[-3000:]}")
        r = results[side] = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT"))[7:])
        full = results["full"]
        print(f"{side:<8} {r['trainable'] / 1e6:>9.2f}M {r['update_s']:>9.2f} {r['update_s'] / full['update_s']:>7.2f}x "
              f"{r['ref_s']:>7.2f} {r['peak_mb']:>12.0f} {r['peak_mb'] / full['peak_mb']:>7.2f}x", flush=True)


def time_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    path = str(smollm2_model_dir())
    batch = group_rollouts(args.prompts, args.n, args.prompt_len, args.response_len, 49152)
    batching = Batching(ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_device=args.micro)
    common = dict(batching=batching, loss={"use_kl_loss": True})
    actors = {"full": ActorWorker(path, optim={"lr": 1e-6}, **common)}
    for r in args.ranks:
        actors[f"lora-{r}"] = ActorWorker(path, optim={"lr": 1e-5}, lora={"rank": r, "alpha": 2 * r}, **common)
    ref = ActorWorker(path, batching=batching, freeze=True)
    batch = batch.union(ref.compute_ref_log_prob(batch, temperature=1.0))
    del ref
    print(f"SmolLM2-135M fp32 updates alternated in one process: {args.prompts} prompts x n {args.n}, prompt "
          f"{args.prompt_len}, response {args.response_len // 2}-{args.response_len}, micro-batch {args.micro}, KL "
          f"loss on, median of {args.steps} rounds after one warm-up round, {args.threads} threads")
    times: dict[str, list[float]] = {side: [] for side in actors}
    for round_ in range(args.steps + 1):
        for side, actor in actors.items():
            start = time.perf_counter()
            actor.update(batch, temperature=1.0)
            if round_:
                times[side].append(time.perf_counter() - start)
    full = statistics.median(times["full"])
    print(f"{'side':<8} {'s/update':>9} {'vs full':>8}   every round")
    for side, ts in times.items():
        med = statistics.median(ts)
        print(f"{side:<8} {med:>9.2f} {med / full:>7.2f}x   {[round(t, 2) for t in ts]}")


# ---------------------------------------------------------------------- recipe runs
def run_recipe(out: str, overrides: list[str], nproc: int) -> list[dict]:
    """The recipe under torchrun with ``overrides``; its metrics.jsonl rows."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           os.path.join(REPO, "recipes", "ppo.py"), "--config", CONFIG, f"trainer.output_dir={out}",
           "trainer.loggers=[jsonl]", "trainer.checkpoint.resume=disable", "trainer.val_before_train=false",
           "trainer.test_freq=0", "trainer.checkpoint.save_freq=0", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"recipe failed ({' '.join(overrides)}):\n{proc.stderr[-4000:]}")
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def step_main(args: argparse.Namespace) -> None:
    print(f"GRPO step of grpo_arithmetic_cpu.yaml, 2 ranks colocated (actor + reference + rollout), steps 2.."
          f"{args.steps} (median), {os.cpu_count()} CPUs")
    print(f"{'side':<8} {'s/step':>7} {'update':>7} {'ref':>6} {'gen':>6} {'rank0 peak RSS GB':>18}")
    for side in sides(args.ranks):
        extra = [] if side == "full" else [*lora_overrides(int(side.split("-")[1])), f"actor.optim.lr={args.lora_lr}"]
        with tempfile.TemporaryDirectory() as out:
            rows = run_recipe(out, [f"trainer.total_steps={args.steps}", *extra], nproc=2)[1:]
        print(f"{side:<8} {_median(rows, 'timing_s/step'):>7.1f} {_median(rows, 'timing_s/update_actor'):>7.1f} "
              f"{_median(rows, 'timing_s/ref'):>6.1f} {_median(rows, 'timing_s/gen'):>6.1f} "
              f"{max(r['perf/max_memory_allocated_gb'] for r in rows):>18.2f}", flush=True)


def sync_main(args: argparse.Namespace) -> None:
    print("split placement (actor rank 0, rollout rank 1), grpo_arithmetic_cpu.yaml: bytes each weight sync sends")
    print(f"{'side':<8} {'weight_sync/bytes':>18} {'vs full':>8} {'send s':>7}")
    full = None
    for side in sides(args.ranks):
        extra = [] if side == "full" else lora_overrides(int(side.split("-")[1]))
        with tempfile.TemporaryDirectory() as out:
            rows = run_recipe(out, ["trainer.total_steps=2", "placement.actor=[0]", "placement.rollout=[1]",
                                    "actor.batching.ppo_micro_batch_size_per_device=16", *extra], nproc=2)
        sent = _median(rows, "weight_sync/bytes")
        full = full or sent
        print(f"{side:<8} {sent:>18.0f} {100 * sent / full:>7.2f}% {_median(rows, 'weight_sync/send_s'):>7.2f}",
              flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["update", "time", "step", "sync"], nargs="?", default="update")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64], help="LoRA ranks beside full fine-tuning")
    ap.add_argument("--n", type=int, default=8, help="update: responses per prompt")
    ap.add_argument("--prompts", type=int, default=2, help="update: prompts (groups) per update")
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--micro", type=int, default=4, help="update: samples per micro-batch")
    ap.add_argument("--steps", type=int, default=3, help="update: measured steps; time: rounds; step: recipe steps (first skipped)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora-lr", type=float, default=1e-4, help="step: the LoRA runs' actor.optim.lr")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # update: the child process of one side
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT", json.dumps(measure_update(args.one, args)))
    else:
        {"update": update_main, "time": time_main, "step": step_main, "sync": sync_main}[args.what](args)


if __name__ == "__main__":
    main()
