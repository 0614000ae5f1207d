"""Laminar's dynamic repack on a long-tailed workload: rollout occupancy and throughput with and without it.

One actor rank and three rollout replicas (ranks 1-3; with repack the last is the long-tail replica), the
stream schedule, REINFORCE++ with one sample per prompt (so a prompt's budget is its sample's length).
Each prompt's response budget (``max_tokens`` in the data; EOS ignored, so every response runs to it) is
``--short`` tokens, or ``--long`` (8x by default) for a seeded random ``--long-share`` (10 %) of them. A
rollout call holds ``--per-call`` samples in as many engine slots; once its short samples end, its slots
hold the few long ones. Same model, prompts, budgets and steps on both sides; each side is one ``torchrun``
of the recipe, run one after the other.

    python tools/bench/bench_repack.py [--steps 10 --warmup 2 --fraction 0.25] [--partial]

Prints, over the steps after ``--warmup``: ``rollout/occupancy/mean`` (decoding slots over engine slots,
per decode step, over all replicas: the hardware-independent figure), trained response tokens per second,
the rollout ranks' busy fraction, samples handed back and the long-tail replica's share of tokens; the last
line is ``occupancy N.NNx`` (with repack / without). On a CPU a decode step's cost grows with the batch, so
consolidating samples saves less time than on a GPU, where a decode step costs about the same at 4 or 64.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from torchrlhf.models import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def write_prompts(path: Path, count: int, short: int, long: int, share: float, seed: int) -> list[int]:
    """Arithmetic prompts, each with a budget of ``long`` tokens with probability ``share``, else ``short``."""
    rows = [json.loads(line) for line in (ROOT / "recipes/data/arithmetic_train.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    budgets = [long if rng.random() < share else short for _ in range(count)]
    path.write_text("".join(json.dumps({**rows[i % len(rows)], "max_tokens": b}) + "\n"
                            for i, b in enumerate(budgets)))
    return budgets


def run_side(name: str, work: Path, model: Path, data: Path, args, extra: list[str]) -> list[dict]:
    out = work / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(ROOT / "recipes/ppo.py"), "--config", str(ROOT / "recipes/configs/grpo_arithmetic_cpu.yaml"),
           f"model_path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "data.system_prompt=null",
           "data.shuffle=false", f"data.train_batch_size={args.batch}", "rollout.n=1",
           "algorithm.adv_estimator=reinforce_pp", f"rollout.max_tokens={args.long}", "rollout.ignore_eos=true",
           "rollout.temperature=1.0", f"rollout.engine.max_batch_size={args.per_call}",
           f"rollout.engine.max_seq_len={args.long + 64}",
           f"actor.batching.ppo_mini_batch_size={args.batch}", "actor.batching.ppo_micro_batch_size_per_device=16",
           "actor.optim.lr=3e-3", "actor.loss.use_kl_loss=false", "actor.loss.rollout_is=token",
           f"reward.reward_fn={Path(__file__).parent / 'bench_async.py'}:e_fraction", "reward.isolate=false",
           "placement.actor=[0]", "placement.rollout=[1,2,3]", "trainer.mode=async",
           f"async_training.max_staleness={args.staleness}", f"async_training.prompts_per_call={args.per_call}",
           f"trainer.total_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
           "trainer.checkpoint.save_freq=0", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
           f"async_training.partial_rollout={str(args.partial).lower()}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="data.train_batch_size (prompts = samples per step)")
    p.add_argument("--per-call", type=int, default=16, help="async_training.prompts_per_call = engine slots")
    p.add_argument("--short", type=int, default=16)
    p.add_argument("--long", type=int, default=128)
    p.add_argument("--long-share", type=float, default=0.1)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--fraction", type=float, default=0.25, help="async_training.repack.min_active_fraction")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--partial", action="store_true", help="both sides with async_training.partial_rollout (carried "
                   "samples of older versions may then join a long-tail call)")
    p.add_argument("--keep", default=None, help="write the runs here instead of a temporary directory")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        model = save_tiny_model(work / "model", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                max_position_embeddings=args.long + 64, initializer_range=1.0)
        data = work / "prompts.jsonl"
        budgets = write_prompts(data, args.batch * (args.steps + 8) * 2, args.short, args.long, args.long_share, seed=0)
        print(f"REINFORCE++ (1 sample per prompt), random Llama (hidden {args.hidden}, {args.layers} layers, SmolLM2 "
              f"vocab), 4 CPU ranks (actor 0, rollout 1-3), stream schedule k={args.staleness}, {args.batch} "
              f"prompts per step, {args.per_call} per call = engine slots; budgets {args.short} tokens, or "
              f"{args.long} for {args.long_share:.0%} of prompts (drawn: {sum(b == args.long for b in budgets)} of "
              f"{len(budgets)}); repack min_active_fraction {args.fraction}, 1 long-tail replica; "
              f"{'partial rollouts; ' if args.partial else ''}steps "
              f"{args.warmup + 1}..{args.steps}")
        sides = {"without repack": [],
                 "with repack": ["async_training.repack.enable=true",
                                 f"async_training.repack.min_active_fraction={args.fraction}"]}
        results = {name: run_side(name.replace(" ", "_"), work, model, data, args, extra)
                   for name, extra in sides.items()}

    print(f"{'side':<16}{'occupancy':>10}{'s/step':>8}{'tokens/s':>10}{'busy':>7}{'repacked':>10}{'tail share':>12}"
          f"{'staleness':>11}")
    figures = {}
    for name, metrics in results.items():
        measured = metrics[args.warmup:]
        occupancy = _mean([m["rollout/occupancy/mean"] for m in measured if "rollout/occupancy/mean" in m])
        step = _mean([m["timing_s/step"] for m in measured])
        tokens = args.batch * _mean([m["response_length/mean"] for m in measured]) / step
        busy = _mean([m["rollout/busy_fraction"] for m in measured if "rollout/busy_fraction" in m])
        repacked = sum(m.get("rollout/repacked/count", 0.0) for m in measured)
        share = _mean([m["rollout/repacked/long_tail_token_share"] for m in measured
                       if "rollout/repacked/long_tail_token_share" in m])
        stale = _mean([m["rollout/staleness/mean"] for m in measured])
        figures[name] = (occupancy, tokens)
        print(f"{name:<16}{occupancy:10.3f}{step:8.2f}{tokens:10.1f}{busy:7.2f}{repacked:10.0f}"
              f"{share if share == share else 0.0:12.2f}{stale:11.2f}")
    (occ0, tok0), (occ1, tok1) = figures["without repack"], figures["with repack"]
    print(f"tokens/s {tok1 / tok0:.2f}x")
    print(f"occupancy {occ1 / occ0:.2f}x")


if __name__ == "__main__":
    main()
