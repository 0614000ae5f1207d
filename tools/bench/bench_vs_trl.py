"""Seconds per GRPO step: the torchrlhf recipe vs TRL's `GRPOTrainer`, same model, data, sizes, same machine.

Both sides: SmolLM2-135M-Instruct (fp32), ``--prompts`` arithmetic prompts per step with ``--n`` completions
each of at most ``--max-tokens`` tokens (EOS ends a completion early on both), one optimizer step per rollout, no KL term
(no reference model), ``--threads`` torch threads, one process. Each side runs in its own subprocess, one
after the other; the first ``--warmup`` steps are excluded. Needs ``pip install -e ".[bench]"`` (TRL).

    python tools/bench/bench_vs_trl.py [--steps 6 --warmup 1 --prompts 2 --n 4 --max-tokens 32 --threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "recipes" / "data" / "arithmetic_train.jsonl"


def run_torchrlhf(args: argparse.Namespace, work: Path) -> tuple[list[float], list[float]]:
    out = work / "torchrlhf"
    overrides = [
        "data.val_files=[]", f"data.train_batch_size={args.prompts}", "data.shuffle=false", f"rollout.n={args.n}",
        f"rollout.max_tokens={args.max_tokens}", "actor.use_kl_loss=false", f"actor.ppo_mini_batch_size={args.prompts}",
        f"actor.ppo_micro_batch_size_per_device={args.prompts * args.n}", "actor.lr=1e-6",
        f"rollout.engine.max_batch_size={args.prompts * args.n}", f"rollout.engine.max_seq_len={64 + args.max_tokens}",
        f"trainer.total_steps={args.steps}", "trainer.test_freq=0", "trainer.save_freq=0",
        f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(ROOT / "recipes/ppo.py"), "--config",
           str(ROOT / "recipes/configs/grpo_arithmetic_cpu.yaml"), *overrides]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrlhf run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["timing_s/step"] for r in rows], [r["response_length/mean"] for r in rows]


TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from torchrlhf.rewards import arithmetic

model_dir, data, out, steps, prompts, n, max_tokens, threads = sys.argv[1:9]
torch.set_num_threads(int(threads))
rows = [json.loads(l) for l in open(data)]
ds = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])

def reward(prompts, completions, ground_truth, **_):
    return [arithmetic.compute_score(c[0]["content"] if isinstance(c, list) else c, g)
            for c, g in zip(completions, ground_truth)]

class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.t = [], None
    def on_step_begin(self, *a, **k):
        self.t = time.perf_counter()
    def on_step_end(self, *a, **k):
        self.times.append(time.perf_counter() - self.t)

times = StepTimes()
# per_device_train_batch_size counts completions: prompts x n per step, one optimizer step per generation.
cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=int(prompts) * int(n), num_generations=int(n),
                 max_completion_length=int(max_tokens), max_steps=int(steps), learning_rate=1e-6, beta=0.0,
                 logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                 dataloader_num_workers=0, seed=0)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                      callbacks=[times])
trainer.train()
lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
print("STEP_TIMES", json.dumps([times.times, lengths]))
"""


def run_trl(args: argparse.Namespace, work: Path, model_dir: str) -> tuple[list[float], list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(
        [sys.executable, "-c", TRL_SCRIPT, model_dir, str(DATA), str(work / "trl"), str(args.steps), str(args.prompts), str(args.n),
         str(args.max_tokens), str(args.threads)],
        env=env, cwd=ROOT, capture_output=True, text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{proc.stderr[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("STEP_TIMES"))
    return json.loads(line.split(" ", 1)[1])


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('TRL is not installed: pip install -e ".[bench]"') from None
    from torchrlhf.models import smollm2_model_dir

    model_dir = str(smollm2_model_dir())
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        ours, our_len = (x[args.warmup:] for x in run_torchrlhf(args, work))
        t1 = time.perf_counter()
        theirs, their_len = (x[args.warmup:] for x in run_trl(args, work, model_dir))
        t2 = time.perf_counter()
    print(f"GRPO step, SmolLM2-135M fp32, {args.prompts} prompts x {args.n} completions x <= {args.max_tokens} tokens, "
          f"{args.threads} threads, steps {args.warmup + 1}..{args.steps}")
    print(f"  torchrlhf : median {statistics.median(ours):6.2f} s/step  (all: {[round(t, 2) for t in ours]}; "
          f"process wall {t1 - t0:.0f} s; mean completion {_mean(our_len):.1f} tokens)")
    print(f"  TRL       : median {statistics.median(theirs):6.2f} s/step  (all: {[round(t, 2) for t in theirs]}; "
          f"process wall {t2 - t1:.0f} s; mean completion {_mean(their_len):.1f} tokens)")
    print(f"  speed-up  : {statistics.median(theirs) / statistics.median(ours):.2f}x")


if __name__ == "__main__":
    main()
