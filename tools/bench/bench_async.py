"""Synchronous vs asynchronous GRPO on a long-tailed workload: trained samples/s, rollout busy fraction, reward.

Four ranks by default: the actor FSDP2-sharded on ranks 0-1, two rollout replicas on ranks 2-3 (split
placement, the layout both modes share; ``--ranks``/``--actor-ranks`` choose another). Every prompt carries a response budget (``max_tokens``) drawn from a Pareto
distribution (shape ``--alpha``) between ``--min-tokens`` and ``--max-tokens``; the model is a small random
Llama that rarely emits EOS, so each response runs to its budget and the step's slowest sample is set by
the tail. Same model, prompts, budgets, batch sizes and steps on every side; each side is one
``torchrun`` of the recipe, run one after another.

    python tools/bench/bench_async.py [--steps 12 --warmup 2 --staleness 1 2] [--partial]

Prints, over the steps after ``--warmup``: trained samples per second (samples per step / mean step
wall time), the ratio to sync, the rollout ranks' busy fraction (share of wall time inside ``generate``),
mean staleness, and the mean reward of the first and last steps (the reward is a task a random model can
learn: the share of the letter 'e' in the response). ``--partial`` adds, for each k, a side with partial
rollouts (new weights loaded between decode steps) and prints the per-token staleness and the share of
samples whose tokens span versions.
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


def e_fraction(solution_str: str, ground_truth, **_) -> float:
    """Share of the response's characters that are the letter 'e' (learnable by a random model)."""
    return solution_str.count("e") / max(len(solution_str), 1)


def write_prompts(path: Path, count: int, lo: int, hi: int, alpha: float, seed: int) -> list[int]:
    """Arithmetic prompts, each with a Pareto-distributed response budget in [lo, hi]."""
    rows = [json.loads(line) for line in (ROOT / "recipes/data/arithmetic_train.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    budgets = []
    with path.open("w") as f:
        for i in range(count):
            budget = min(hi, int(lo * rng.paretovariate(alpha)))
            budgets.append(budget)
            f.write(json.dumps({**rows[i % len(rows)], "max_tokens": budget}) + "\n")
    return budgets


def run_side(name: str, work: Path, model: Path, data: Path, args, extra: list[str]) -> list[dict]:
    out = work / name
    actor, rollout = list(range(args.actor_ranks)), list(range(args.actor_ranks, args.ranks))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           str(ROOT / "recipes/ppo.py"), "--config", str(ROOT / "recipes/configs/grpo_arithmetic_cpu.yaml"),
           f"model_path={model}", f"data.train_files=[{data}]", "data.val_files=[]", "data.system_prompt=null",
           f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}", f"rollout.max_tokens={args.max_tokens}",
           "rollout.temperature=1.0", f"rollout.engine.max_batch_size={args.prompts * args.n}",
           f"rollout.engine.max_seq_len={args.max_tokens + 64}",
           f"actor.batching.ppo_mini_batch_size={args.prompts}", "actor.batching.ppo_micro_batch_size_per_device=8",
           "actor.optim.lr=3e-3", "actor.loss.use_kl_loss=false", "actor.loss.rollout_is=token",
           f"reward.reward_fn={Path(__file__).resolve()}:e_fraction", "reward.isolate=false",
           f"placement.actor={actor}".replace(" ", ""), f"placement.rollout={rollout}".replace(" ", ""),
           f"trainer.total_steps={args.steps}", "trainer.val_before_train=false", "trainer.test_freq=0",
           "trainer.checkpoint.save_freq=0", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto shape of the budgets (smaller: heavier tail)")
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompts-per-call", type=int, default=2, help="async_training.prompts_per_call")
    p.add_argument("--ranks", type=int, default=4, help="world size")
    p.add_argument("--actor-ranks", type=int, help="the actor's ranks (FSDP2), the first ones; the rest are "
                   "rollout replicas (default: half)")
    p.add_argument("--partial", action="store_true", help="also run each k with async_training.partial_rollout")
    p.add_argument("--keep", default=None, help="write the runs here instead of a temporary directory")
    args = p.parse_args()
    args.actor_ranks = args.actor_ranks or args.ranks // 2
    if not 1 <= args.actor_ranks < args.ranks:
        p.error(f"--actor-ranks must be in [1, {args.ranks - 1}]")

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        model = save_tiny_model(work / "model", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=4,
                                max_position_embeddings=args.max_tokens + 64, initializer_range=1.0)
        data = work / "prompts.jsonl"
        budgets = write_prompts(data, args.prompts * (args.steps + 4) * 2, args.min_tokens, args.max_tokens,
                                args.alpha, seed=0)
        mean_budget = sum(budgets) / len(budgets)
        a = args.actor_ranks
        layout = (f"actor 0-{a - 1} FSDP2" if a > 1 else "actor 0") + f", rollout {a}-{args.ranks - 1}"
        print(f"GRPO, random Llama (hidden {args.hidden}, {args.layers} layers, SmolLM2 vocab), {args.ranks} CPU "
              f"ranks ({layout}), {args.prompts} prompts x {args.n} samples per step, "
              f"response budgets Pareto(alpha={args.alpha}) in [{args.min_tokens}, {args.max_tokens}] "
              f"(mean {mean_budget:.0f}, max {max(budgets)}); steps {args.warmup + 1}..{args.steps}")
        sides = [("sync", ["trainer.mode=sync"])]
        sides += [(f"async k={k}", ["trainer.mode=async", f"async_training.max_staleness={k}",
                                    f"async_training.prompts_per_call={args.prompts_per_call}"])
                  for k in args.staleness]
        if args.partial:
            sides += [(f"{name} partial", [*extra, "async_training.partial_rollout=true"])
                      for name, extra in sides[1:]]
        results = {name: run_side(name.replace(" ", "_").replace("=", ""), work, model, data, args, extra)
                   for name, extra in sides}

    samples = args.prompts * args.n
    base = None
    print(f"{'mode':<19}{'s/step':>8}{'samples/s':>11}{'vs sync':>9}{'tokens/s':>10}{'vs sync':>9}{'busy':>7}"
          f"{'staleness':>11}{'tok stale':>10}{'mixed':>7}{'resp len':>10}{'requeued':>10}{'reward first3':>15}"
          f"{'last3':>7}")
    base_tokens = None
    for name, metrics in results.items():
        measured = metrics[args.warmup:]
        step = sum(m["timing_s/step"] for m in measured) / len(measured)
        rate = samples / step
        base = base or rate
        busy = [m["rollout/busy_fraction"] for m in measured if "rollout/busy_fraction" in m]
        scores = [m["critic/score/mean"] for m in metrics]
        resp = sum(m["response_length/mean"] for m in measured) / len(measured)
        tokens = samples * resp / step  # trained response tokens per second
        base_tokens = base_tokens or tokens
        partial = [(m["rollout/partial/token_staleness_mean"], m["rollout/partial/mixed_version_frac"])
                   for m in measured if "rollout/partial/mixed_version_frac" in m]
        tok_stale = f"{sum(t for t, _ in partial) / len(partial):10.2f}" if partial else f"{'-':>10}"
        mixed = f"{sum(x for _, x in partial) / len(partial):7.2f}" if partial else f"{'-':>7}"
        print(f"{name:<19}{step:8.2f}{rate:11.2f}{rate / base:8.2f}x{tokens:10.1f}{tokens / base_tokens:8.2f}x"
              f"{sum(busy) / len(busy):7.2f}"
              f"{sum(m['rollout/staleness/mean'] for m in measured) / len(measured):11.2f}{tok_stale}{mixed}{resp:10.1f}"
              f"{metrics[-1].get('async/requeued_groups', 0.0):10.0f}"
              f"{sum(scores[:3]) / 3:15.3f}{sum(scores[-3:]) / 3:7.3f}")


if __name__ == "__main__":
    main()
