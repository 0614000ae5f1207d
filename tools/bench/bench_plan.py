"""The planner's simulator against measured step times on this machine.

Runs the SmolLM2 GRPO arithmetic recipe (and, with ``--ppo``, PPO with a critic on a tiny model instead) for 3 steps
under several mappings (colocated / split, sync / async, micro-batch budgets; world size 2 and 4), each a fresh
torchrun, and compares the median of steps 2..'s ``timing_s/step`` with the simulator's estimate for the same mapping
(`torchrlhf.plan`) from a hardware profile calibrated here first, on the run's architecture as ``recipes/ppo.py
--calibrate --config`` does (``--hardware`` reuses a profile). Responses ignore EOS so that every run decodes exactly
``rollout.max_tokens`` tokens per sample: the workload is the same in the simulator and the run.

    python tools/bench/bench_plan.py [--ppo] [--hardware FILE] [--steps 3] [--rounds 1]

With ``--rounds R`` every mapping runs R times, the table once per round, and a mapping's measured time is the
fastest of its rounds: on a shared host, noise only ever slows a run down (the calibration keeps the best of its
probes the same way), and a round-robin spreads the host's slow spells over every mapping alike.

Prints one row per mapping (predicted, measured, error), then, per world size, the planner's own pick (searched
over every mapping, run and measured) against the best measured row, and ``Kendall tau T`` and ``max error E %``
over the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from itertools import combinations
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes"))

from torchrlhf.models.loading import save_tiny_model  # noqa: E402
from torchrlhf.plan.calibrate import calibrate  # noqa: E402
from torchrlhf.plan.hardware import load_hardware, save_hardware  # noqa: E402
from torchrlhf.plan.auto import plan  # noqa: E402
from torchrlhf.plan.problem import config_mapping, plan_input  # noqa: E402
from torchrlhf.plan.simulate import step_estimate  # noqa: E402
from torchrlhf.trainer.run import load  # noqa: E402

GRPO = "recipes/configs/grpo_arithmetic_cpu.yaml"
WORKLOAD = ["data.train_batch_size=8", "rollout.n=4", "rollout.max_tokens=24", "rollout.ignore_eos=true",
            "actor.batching.ppo_mini_batch_size=8", "trainer.val_before_train=false", "trainer.test_freq=0",
            "trainer.checkpoint.save_freq=0", "trainer.loggers=[jsonl]", "rollout.engine.max_batch_size=32"]
SPLIT = ["placement.actor=[0]", "placement.rollout=[1]"]
SPLIT4 = ["placement.actor=[0,1]", "placement.rollout=[2,3]"]
ASYNC = ["trainer.mode=async", "async_training.max_staleness=1", "async_training.prompts_per_call=8"]
MAPPINGS = [  # (world size, overrides)
    (2, ["actor.batching.ppo_micro_batch_size_per_device=16"]),
    (2, ["actor.batching.ppo_micro_batch_size_per_device=4"]),
    (2, SPLIT + ["actor.batching.ppo_micro_batch_size_per_device=16"]),
    (2, SPLIT + ASYNC + ["actor.batching.ppo_micro_batch_size_per_device=16"]),
    (4, ["actor.batching.ppo_micro_batch_size_per_device=8"]),
    (4, ["actor.batching.ppo_micro_batch_size_per_device=2"]),
    (4, SPLIT4 + ["actor.batching.ppo_micro_batch_size_per_device=8"]),
    (4, SPLIT4 + ASYNC[:2] + ["async_training.prompts_per_call=4", "actor.batching.ppo_micro_batch_size_per_device=8"]),
]
# PPO: GAE over a critic of the actor's architecture, one sample per prompt; the model is `save_tiny_model`'s
PPO_WORKLOAD = ["data.train_batch_size=32", "rollout.n=1", "rollout.max_tokens=24", "rollout.ignore_eos=true",
                "algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=1.0",
                "actor.batching.ppo_mini_batch_size=32", "critic.model_path=${model_path}",
                "critic.batching.ppo_mini_batch_size=32", "trainer.val_before_train=false", "trainer.test_freq=0",
                "trainer.checkpoint.save_freq=0", "trainer.loggers=[jsonl]", "rollout.engine.max_batch_size=32"]
MICRO = ["actor.batching.ppo_micro_batch_size_per_device={0}", "critic.batching.ppo_micro_batch_size_per_device={0}"]


def micro(size: int) -> list[str]:
    return [m.format(size) for m in MICRO]


PPO_MAPPINGS = [
    (2, micro(16)),
    (2, micro(4)),
    (2, ["placement.actor=[0]", "placement.critic=[1]"] + micro(32)),
    (2, SPLIT + micro(32)),
    (2, SPLIT + ASYNC + micro(32)),
    (2, ["actor.tp_size=2", "critic.tp_size=2", "rollout.tp_size=2"] + micro(32)),
    (4, micro(8)),
    (4, ["placement.actor=[0,1]", "placement.critic=[2,3]"] + micro(16)),
    (4, SPLIT4 + ["async_training.prompts_per_call=16"] + ASYNC[:2] + micro(16)),
]


def measure(world: int, workload: list[str], overrides: list[str], out: Path, steps: int) -> dict[str, float]:
    """``timing_s/*`` of the step whose ``timing_s/step`` is the median of steps 2.. of a fresh torchrun of the
    recipe."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = ["torchrun", f"--nproc_per_node={world}", "recipes/ppo.py", "--config", GRPO, *workload, *overrides,
           f"trainer.total_steps={steps}", f"trainer.output_dir={out}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = sorted((r for r in rows if "timing_s/step" in r and r["step"] > 1), key=lambda r: r["timing_s/step"])
    median = rows[(len(rows) - 1) // 2]
    return {k.split("/", 1)[1]: v for k, v in sorted(median.items()) if k.startswith("timing_s/")}


def fastest(runs: list[dict[str, float]]) -> tuple[dict[str, float], list[float]]:
    """The fastest of a mapping's runs, and every run's step time."""
    return min(runs, key=lambda r: r["step"]), [r["step"] for r in runs]


def kendall_tau(a: list[float], b: list[float]) -> float:
    pairs = list(combinations(range(len(a)), 2))
    score = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1) for i, j in pairs if a[i] != a[j] and b[i] != b[j])
    return score / len(pairs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ppo", action="store_true", help="PPO with a critic on a tiny model instead of SmolLM2 GRPO")
    parser.add_argument("--hardware", help="a profile file; default: calibrate here first")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="runs per mapping, round-robin; the fastest counts")
    parser.add_argument("--only", type=int, nargs="*", help="mapping indices to run")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workload, mappings, model_dir, smallest = WORKLOAD, MAPPINGS, None, micro(1)[:1]
        if args.ppo:
            model_dir = str(save_tiny_model(Path(tmp) / "tiny"))
            workload, mappings, smallest = [f"model_path={model_dir}", *PPO_WORKLOAD], PPO_MAPPINGS, micro(1)
        if args.hardware:
            hw = load_hardware(args.hardware)
        else:
            hw = calibrate("cpu", threads=1, model_dir=model_dir)
            name = f"bench_plan_hardware{'_ppo' if args.ppo else ''}.yaml"
            print(f"calibrated: {save_hardware(hw, Path(tempfile.gettempdir()) / name)}")
        todo = [(i, world, overrides) for i, (world, overrides) in enumerate(mappings)
                if not args.only or i in args.only]
        runs: dict[int, list[dict[str, float]]] = {i: [] for i, _, _ in todo}
        for round_ in range(args.rounds):
            for i, world, overrides in todo:
                out = Path(tmp) / f"run{i}" / f"round{round_}"
                runs[i].append(measure(world, workload, overrides, out, args.steps))
                print(f"round {round_ + 1}: [{i}] measured {runs[i][-1]['step']:.2f} s", flush=True)
        for i, world, overrides in todo:
            cfg, _ = load(ROOT / GRPO, [*workload, *overrides], world)
            data = plan_input(cfg)
            predicted = step_estimate(data.problem, config_mapping(cfg, world), hw, node_size=world)
            stages, each = fastest(runs[i])
            measured = stages["step"]
            rows.append((i, world, overrides, predicted.seconds, measured, predicted))
            print(f"[{i}] world {world} {' '.join(overrides) or '(colocated)'}: predicted {predicted.seconds:.2f} s "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in predicted.by_stage().items())}), measured {measured:.2f} s "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in stages.items() if k != 'step')}; rounds "
                  f"{' '.join(f'{t:.2f}' for t in each)}), error {100 * (predicted.seconds / measured - 1):+.0f} %",
                  flush=True)
        pick = {}
        for world in sorted({r[1] for r in rows}):
            cfg, _ = load(ROOT / GRPO, [*workload, *smallest], world)
            best = plan(cfg, world, hardware=hw).best
            measured, each = fastest([measure(world, workload, best.overrides, Path(tmp) / f"pick{world}" / f"round{r}",
                                              args.steps) for r in range(args.rounds)])
            pick[world] = (best, measured["step"])
            print(f"planner's pick at world size {world}: {' '.join(best.overrides)}: predicted "
                  f"{best.estimate.seconds:.2f} s, measured {measured['step']:.2f} s "
                  f"({', '.join(f'{k} {v:.2f}' for k, v in measured.items() if k != 'step')}; rounds "
                  f"{' '.join(f'{t:.2f}' for t in each)})", flush=True)
    predicted, measured = [r[3] for r in rows], [r[4] for r in rows]
    print("\n| # | world | mapping | predicted s | measured s | error |")
    print("|---|---|---|---|---|---|")
    for i, world, overrides, p, m, _ in rows:
        print(f"| {i} | {world} | {' '.join(overrides) or 'colocated'} | {p:.2f} | {m:.2f} | {100 * (p / m - 1):+.0f} % |")
    for world in sorted({r[1] for r in rows}):
        of_world = [r for r in rows if r[1] == world]
        best_measured = min(of_world, key=lambda r: r[4])
        best_predicted = min(of_world, key=lambda r: r[3])
        print(f"world {world}: best measured [{best_measured[0]}] {best_measured[4]:.2f} s; the simulator's best of "
              f"these [{best_predicted[0]}] measured {best_predicted[4]:.2f} s "
              f"({100 * (best_predicted[4] / best_measured[4] - 1):+.0f} %)")
        if world in pick:
            best, seconds = pick[world]
            print(f"world {world}: the planner's own pick measured {seconds:.2f} s "
                  f"({100 * (seconds / best_measured[4] - 1):+.0f} % against the best of the table; predicted "
                  f"{best.estimate.seconds:.2f} s, error {100 * (best.estimate.seconds / seconds - 1):+.0f} %)")
    if len(rows) > 1:  # a ranking needs two rows (``--only`` may leave one)
        print(f"Kendall tau {kendall_tau(predicted, measured):.2f}")
    print(f"max error {max(abs(p / m - 1) for p, m in zip(predicted, measured)) * 100:.0f} %")


if __name__ == "__main__":
    main()
