"""The planner at paper scale (simulation only): PPO and GRPO for 7 B to 70 B on 16 to 128 H100s.

HybridFlow's evaluation workload (arXiv 2409.19256, §8): prompts and responses of 1 024 tokens, 1 024 samples per
step; PPO with an actor, a critic, a reference and a reward model of the same size; here also GRPO (128 prompts × 8,
no critic, no reward model: a rule reward). Model shapes come from `tools/bench/shapes/*/config.json` (public
architectures, no weights); the hardware is the shipped ``h100`` profile. Prints the chosen mapping of each case,
and checks that full-parameter PPO of 70 B on one node of 8 has no plan.

    python tools/bench/bench_plan_scale.py [--models llama2-7b llama2-70b] [--gpus 16 128] [--hardware h100]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from torchrlhf.plan.hardware import load_hardware
from torchrlhf.plan.auto import describe, plan
from torchrlhf.trainer.run import load

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "tools" / "bench" / "shapes"
MODELS = ["llama2-7b", "llama2-13b", "codellama-34b", "llama2-70b"]


def config(model: str, algorithm: str) -> dict:
    path = str(SHAPES / model)
    trained = {"model_path": path, "dtype": "bfloat16", "memory": {"activation_checkpointing": True},
               "batching": {"ppo_mini_batch_size": 256 if algorithm == "ppo" else 32,
                            "ppo_micro_batch_size_per_device": 1}}
    cfg = {
        "tokenizer_path": "smollm2",  # the planner reads no text here (prompt lengths are given)
        "data": {"train_files": [str(ROOT / "recipes/data/arithmetic_train.jsonl")], "max_prompt_length": 1024,
                 "train_batch_size": 1024 if algorithm == "ppo" else 128},
        "rollout": {"n": 1 if algorithm == "ppo" else 8, "max_tokens": 1024,
                    "engine": {"max_batch_size": 128, "max_seq_len": 2048}},
        "actor": {**trained, "loss": {"use_kl_loss": algorithm == "grpo"}},
        "algorithm": {"adv_estimator": "gae" if algorithm == "ppo" else "grpo",
                      "use_kl_in_reward": algorithm == "ppo"},
        "trainer": {"total_steps": 1},
    }
    if algorithm == "ppo":
        cfg["critic"] = {**trained, "batching": dict(trained["batching"])}
        cfg["reward_model"] = {"model_path": path, "dtype": "bfloat16"}
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=MODELS)
    parser.add_argument("--gpus", nargs="*", type=int, default=[16, 32, 64, 128])
    parser.add_argument("--algorithms", nargs="*", default=["ppo", "grpo"])
    parser.add_argument("--hardware", default="h100")
    args = parser.parse_args()
    hw = load_hardware(args.hardware)
    print(f"hardware {hw.name}; prompts and responses of 1024 tokens; 1024 samples per step")
    print("| model | algorithm | GPUs | step s (simulated) | schedule | placement | mapping | planning s |")
    print("|---|---|---|---|---|---|---|---|")
    for model in args.models:
        for algorithm in args.algorithms:
            for gpus in args.gpus:
                cfg, _ = load(config(model, algorithm), [], gpus)
                start = time.perf_counter()
                result = plan(cfg, gpus, hardware=hw, nodes=max(1, gpus // 8), prompt_len=1024.0)
                took = time.perf_counter() - start
                best = result.best
                if best is None:
                    print(f"| {model} | {algorithm} | {gpus} | no plan (smallest fit: {result.smallest_fit}) | | | | "
                          f"{took:.1f} |", flush=True)
                    continue
                m = best.mapping
                schedule = "sync" if m.mode == "sync" else f"async k={m.max_staleness}"
                print(f"| {model} | {algorithm} | {gpus} | {best.estimate.seconds:.1f} | {schedule} | {best.placement} | "
                      f"{describe(best)} | {took:.1f} |", flush=True)
    cfg, _ = load(config("llama2-70b", "ppo"), [], 8)
    result = plan(cfg, 8, hardware=hw, nodes=1, prompt_len=1024.0)
    print("full-parameter PPO of llama2-70b on 8 GPUs: "
          + ("no plan" if result.best is None else f"a plan ({describe(result.best)})")
          + (f"; the smallest cluster with one: {result.smallest_fit} GPUs" if result.smallest_fit else ""))


if __name__ == "__main__":
    main()
