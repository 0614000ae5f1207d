"""GRPO end to end on SmolLM2-135M: seconds/step, tokens/s, phase breakdown, controller and RPC overhead.

Runs the real recipe pieces (config schema, builder, `RLTrainer`) on a fixed small setting — by default
8 prompts x 4 samples x <= 64 new tokens, KL loss on (so the reference role runs) — and prints, over the
steps after ``--warmup``:

* seconds per step and tokens/s (prompt + response tokens, all ranks);
* the phases the controller times (gen, reward, old_log_prob, ref, adv, update_actor) as shares of the step;
* controller time (step minus the role calls) and dispatch/RPC time (the controller's wall time of the
  role calls minus the slowest rank's time inside those methods, from `FSDPWorker.busy_seconds`).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 tools/bench/bench_e2e.py [--steps 4 --warmup 1]
    python tools/bench/bench_e2e.py --engine vllm       # the same step with vLLM rollouts (needs the vllm extra)
"""

from __future__ import annotations

import argparse
import os

from torchrlhf.config import load_config
from torchrlhf.runtime import launch
from torchrlhf.trainer.build import build_trainer
from torchrlhf.trainer.schema import load_recipe_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --engine -> the rollout.engine overrides for a batch of this many samples per rank
ENGINES = {
    "native": lambda batch: ["rollout.engine._component_=torchrlhf.generation.NativeEngine",
                             f"rollout.engine.max_batch_size={batch}", "rollout.engine.max_seq_len=160"],
    "vllm": lambda batch: ["rollout.engine._component_=torchrlhf.generation.VLLMEngine",
                           f"rollout.engine.max_batch_size={batch}", "rollout.engine.max_seq_len=160"],
}
ROLE_PHASES = {"gen": "generate", "old_log_prob": "compute_log_prob", "ref": "compute_ref_log_prob",
               "update_actor": "update", "values": "compute_values", "update_critic": "update"}


def bench(cfg, world: int, warmup: int) -> None:
    trainer = build_trainer(cfg, world)
    steps: list[dict[str, float]] = []
    try:
        while trainer.global_step < cfg.trainer.total_steps:
            trainer.global_step += 1
            if trainer.global_step == warmup + 1:
                busy_before = {name: g.busy_seconds() for name, g in _groups(trainer).items()}
            steps.append(trainer.train_step())
        busy_after = {name: g.busy_seconds() for name, g in _groups(trainer).items()}
    finally:
        trainer.close()
    measured = steps[warmup:]
    total = sum(m["timing_s/step"] for m in measured)
    tokens = sum(m["perf/total_num_tokens"] for m in measured)
    n = len(measured)
    engine = trainer.roles.rollout.engine_info()["engine"]
    print(f"\nGRPO, SmolLM2-135M fp32, {engine} rollouts, {world} rank(s), "
          f"{cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples "
          f"x <= {cfg.rollout.max_tokens} new tokens; steps {warmup + 1}..{warmup + n}")
    print(f"  step            {total / n:8.2f} s   ({tokens / total:.0f} tokens/s over all ranks, "
          f"mean response {sum(m['response_length/mean'] for m in measured) / n:.1f} tokens)")
    phase_total = 0.0
    for phase in ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor"]:
        t = sum(m.get(f"timing_s/{phase}", 0.0) for m in measured)
        phase_total += t
        print(f"  {phase:<15} {t / n:8.2f} s   {100 * t / total:5.1f}%")
    role_wall = sum(sum(m.get(f"timing_s/{p}", 0.0) for m in measured) for p in ROLE_PHASES)
    role_busy = 0.0
    for name, after in busy_after.items():  # per role: the slowest rank's busy time in the measured steps
        per_rank = [sum(a.get(meth, 0.0) - b.get(meth, 0.0) for meth in set(ROLE_PHASES.values()))
                    for (_, a), (_, b) in zip(after, busy_before[name])]
        role_busy += max(per_rank)
    controller = total - role_wall
    print(f"  controller      {controller / n:8.2f} s   {100 * controller / total:5.1f}%  "
          "(rewards, advantages, batch assembly, metrics)")
    print(f"  dispatch + RPC  {(role_wall - role_busy) / n:8.2f} s   {100 * (role_wall - role_busy) / total:5.1f}%  "
          "(role calls' wall time minus time inside the worker methods)")


def _groups(trainer) -> dict:
    roles = trainer.roles
    return {name: getattr(roles, name) for name in ("actor", "rollout", "ref", "critic")
            if getattr(roles, name) is not None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--micro", type=int, default=4, help="ppo_micro_batch_size_per_device")
    p.add_argument("--engine", choices=sorted(ENGINES), default="native", help="the rollout engine")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    overrides = [
        "data.val_files=[]", f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}", f"actor.batching.ppo_mini_batch_size={args.prompts}",
        f"actor.batching.ppo_micro_batch_size_per_device={args.micro}",
        *ENGINES[args.engine](args.prompts * args.n // world),
        f"trainer.total_steps={args.steps}", "trainer.test_freq=0", "trainer.checkpoint.save_freq=0",
        "trainer.output_dir=/tmp/torchrlhf_bench_e2e", "trainer.loggers=[jsonl]",
    ]
    raw = load_config(os.path.join(ROOT, "recipes/configs/grpo_arithmetic_cpu.yaml"), overrides, add_missing=True)
    cfg = load_recipe_config(raw, world)
    launch(bench, cfg, world, args.warmup)


if __name__ == "__main__":
    main()
