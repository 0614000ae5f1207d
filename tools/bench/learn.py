"""Does a real model learn? Train SmolLM2-135M-Instruct with GRPO per seed; print held-out accuracy before/after.

Runs the recipe once per seed, one process at a time (each gets the whole machine), and reads
each run's ``metrics.jsonl``: greedy validation accuracy at step 0 and at the last step, the
rise in points, the step count and the wall time of the whole run (load, validations included).

    python tools/bench/learn.py                                  # 3 seeds of grpo_arithmetic_learn.yaml
    python tools/bench/learn.py --seeds 0 --plot docs/learning_arithmetic.png
    python tools/bench/learn.py --config recipes/configs/grpo_gsm8k_smollm2.yaml -- trainer.total_steps=40

Arguments after ``--`` are config overrides passed to every run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from torchrlhf.utils.logging import read_metrics  # noqa: E402


def run_seed(config: str, seed: int, out_dir: str, overrides: list[str]) -> float:
    """Train one seed in a fresh process; returns its wall time in seconds."""
    cmd = [sys.executable, os.path.join(REPO, "recipes", "ppo.py"), "--config", config,
           f"trainer.seed={seed}", f"data.seed={seed}", f"actor.seed={seed}",
           f"trainer.output_dir={out_dir}", "trainer.loggers=[console,jsonl]", "trainer.checkpoint.resume=disable", *overrides]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    return time.perf_counter() - start


def accuracy_curve(metrics_path: str) -> list[tuple[int, dict[str, float]]]:
    """(step, {val metric: value}) for every step that validated."""
    rows = read_metrics(metrics_path)
    curve = [(row["step"], {k: v for k, v in row.items() if k.startswith("val/")}) for row in rows]
    return [(step, vals) for step, vals in curve if vals]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(REPO, "recipes", "configs", "grpo_arithmetic_learn.yaml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default=os.path.join(REPO, "outputs", "learn"), help="one sub-folder per seed")
    parser.add_argument("--plot", default=None, help="also draw every seed's curves into this PNG (needs matplotlib)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (after --)")
    args = parser.parse_args()

    results = []
    for seed in args.seeds:
        out_dir = os.path.join(args.out, f"seed{seed}")
        if os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
            os.remove(os.path.join(out_dir, "metrics.jsonl"))  # a fresh curve, not appended to an old one
        wall = run_seed(args.config, seed, out_dir, args.overrides)
        curve = accuracy_curve(os.path.join(out_dir, "metrics.jsonl"))
        if len(curve) < 2 or curve[0][0] != 0:
            raise SystemExit(f"seed {seed}: need validation at step 0 and later (trainer.val_before_train, test_freq)")
        (_, before), (last_step, after) = curve[0], curve[-1]
        for name in sorted(before):
            results.append((seed, name, before[name], after[name], last_step, wall))
            print(f"seed {seed}: {name} {before[name]:.3f} -> {after[name]:.3f} "
                  f"({100 * (after[name] - before[name]):+.1f} pts) after {last_step} steps, {wall / 60:.1f} min wall",
                  flush=True)

    print(f"\n{'seed':>4}  {'metric':<24} {'before':>7} {'after':>7} {'rise':>7} {'steps':>5} {'wall min':>8}")
    for seed, name, b, a, steps, wall in results:
        print(f"{seed:>4}  {name:<24} {b:>7.3f} {a:>7.3f} {100 * (a - b):>+6.1f}p {steps:>5} {wall / 60:>8.1f}")
    for name in sorted({r[1] for r in results}):
        rows = [r for r in results if r[1] == name]
        rises = [100 * (r[3] - r[2]) for r in rows]
        print(f"mean  {name:<24} {statistics.mean(r[2] for r in rows):>7.3f} {statistics.mean(r[3] for r in rows):>7.3f} "
              f"{statistics.mean(rises):>+6.1f}p  (min rise {min(rises):+.1f}p, min after "
              f"{min(r[3] for r in rows):.3f}, max wall {max(r[5] for r in rows) / 60:.1f} min)")

    if args.plot:
        logs = [os.path.join(args.out, f"seed{seed}", "metrics.jsonl") for seed in args.seeds]
        subprocess.run([sys.executable, os.path.join(REPO, "tools", "plot_metrics.py"), *logs,
                        "--labels", *[f"seed {s}" for s in args.seeds], "--out", args.plot,
                        "--title", os.path.basename(args.config)], check=True)


if __name__ == "__main__":
    main()
