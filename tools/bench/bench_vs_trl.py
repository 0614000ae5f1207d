"""Seconds per GRPO step: the torchrlhf recipe vs TRL's `GRPOTrainer`, same model, data, sizes, same machine.

Both sides: SmolLM2-135M-Instruct (fp32), per step ``prompts`` prompts with ``n`` completions each of at most
``max_tokens`` tokens (EOS ends a completion early on both), sampled at temperature 1, one optimizer step per
rollout, no KL term (no reference model), the same chat template and no system prompt of ours,
``--threads`` torch threads, one process. Settings (``--settings``):

- ``arithmetic``: recipes/data/arithmetic_train.jsonl, 2 prompts x 4 x 32 tokens (short prompts);
- ``arithmetic8``: the same data, 8 prompts x 4 x 64 tokens;
- ``gsm8k``: data/gsm8k/gsm8k_train.jsonl (``tools/prepare_gsm8k.py``), 8 prompts x 8 x 64 tokens.

``--prompts/--n/--max-tokens`` override every chosen setting. Each side runs in its own subprocess,
one after the other; the first ``--warmup`` steps are excluded. Both sides' mean prompt and completion
tokens are printed, so that equal work is visible. Needs ``pip install -e ".[bench]"`` (TRL).

    python tools/bench/bench_vs_trl.py [--settings arithmetic gsm8k --steps 5 --warmup 1 --threads 2]
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
SETTINGS = {
    "arithmetic": dict(config="grpo_arithmetic_cpu.yaml", data="recipes/data/arithmetic_train.jsonl",
                       reward="arithmetic", prompt_len=64, prompts=2, n=4, max_tokens=32),
    "arithmetic8": dict(config="grpo_arithmetic_cpu.yaml", data="recipes/data/arithmetic_train.jsonl",
                        reward="arithmetic", prompt_len=64, prompts=8, n=4, max_tokens=64),
    "gsm8k": dict(config="grpo_gsm8k_smollm2.yaml", data="data/gsm8k/gsm8k_train.jsonl", reward="gsm8k",
                  prompt_len=256, prompts=8, n=8, max_tokens=64),
}


def run_torchrlhf(s: dict, args: argparse.Namespace, work: Path) -> tuple[list[float], list[float], list[float]]:
    out = work / "torchrlhf"
    b = s["prompts"] * s["n"]
    overrides = [
        f"data.train_files=[{s['data']}]", "data.val_files=[]", "data.system_prompt=null",
        f"data.max_prompt_length={s['prompt_len']}", f"data.train_batch_size={s['prompts']}", "data.shuffle=false",
        f"rollout.n={s['n']}", f"rollout.max_tokens={s['max_tokens']}", "rollout.temperature=1.0",
        "actor.dtype=float32", "actor.use_kl_loss=false", f"actor.batching.ppo_mini_batch_size={s['prompts']}",
        f"actor.batching.ppo_micro_batch_size_per_device={b}", "actor.optim.lr=1e-6", "algorithm.use_kl_in_reward=false",
        f"rollout.engine.max_batch_size={b}", f"rollout.engine.max_seq_len={s['prompt_len'] + s['max_tokens']}",
        f"trainer.total_steps={args.steps}", "trainer.test_freq=0", "trainer.save_freq=0",
        "trainer.val_before_train=false", f"trainer.output_dir={out}", "trainer.loggers=[jsonl]",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, str(ROOT / "recipes/ppo.py"), "--config", str(ROOT / "recipes/configs" / s["config"]),
           *overrides]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrlhf run failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "timing_s/step" in r]
    return ([r["timing_s/step"] for r in rows], [r["response_length/mean"] for r in rows],
            [r["prompt_length/mean"] for r in rows])


TRL_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
import importlib

model_dir, data, out, steps, prompts, n, max_tokens, threads, reward_name = sys.argv[1:10]
torch.set_num_threads(int(threads))
score = importlib.import_module(f"torchrlhf.rewards.{reward_name}").compute_score
rows = [json.loads(l) for l in open(data)]
ds = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])

def reward(prompts, completions, ground_truth, **_):
    return [score(c[0]["content"] if isinstance(c, list) else c, g) for c, g in zip(completions, ground_truth)]

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
                 temperature=1.0,
                 logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                 dataloader_num_workers=0, seed=0)
tok = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=cfg, train_dataset=ds, processing_class=tok,
                      callbacks=[times])
trainer.train()
lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
# TRL does not log its prompts' lengths: the mean templated length of the file's first 512 rows stands in.
prompt_lens = [len(tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False).input_ids) for r in rows[:512]]
print("STEP_TIMES", json.dumps([times.times, lengths, [sum(prompt_lens) / len(prompt_lens)]]))
"""


def run_trl(s: dict, args: argparse.Namespace, work: Path, model_dir: str) -> list[list[float]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(
        [sys.executable, "-c", TRL_SCRIPT, model_dir, str(ROOT / s["data"]), str(work / "trl"), str(args.steps),
         str(s["prompts"]), str(s["n"]), str(s["max_tokens"]), str(args.threads), s["reward"]],
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
    p.add_argument("--settings", nargs="+", default=["arithmetic", "gsm8k"], choices=list(SETTINGS))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, help="prompts per step (overrides the settings')")
    p.add_argument("--n", type=int, help="completions per prompt (overrides the settings')")
    p.add_argument("--max-tokens", type=int, help="(overrides the settings')")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('TRL is not installed: pip install -e ".[bench]"') from None
    from torchrlhf.models import smollm2_model_dir

    model_dir = str(smollm2_model_dir())
    for name in args.settings:
        s = dict(SETTINGS[name])
        s.update({k: v for k, v in (("prompts", args.prompts), ("n", args.n), ("max_tokens", args.max_tokens)) if v})
        if not (ROOT / s["data"]).is_file():
            raise SystemExit(f"{name}: {s['data']} is missing (GSM8K: python tools/prepare_gsm8k.py "
                             "--input-dir ../shared/data/gsm8k --out data/gsm8k)")
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            t0 = time.perf_counter()
            ours, our_len, our_prompt = (x[args.warmup:] for x in run_torchrlhf(s, args, work))
            t1 = time.perf_counter()
            theirs, their_len, their_prompt = run_trl(s, args, work, model_dir)
            theirs, their_len = theirs[args.warmup:], their_len[args.warmup:]
            t2 = time.perf_counter()
        print(f"[{name}] GRPO step, SmolLM2-135M fp32, {s['prompts']} prompts x {s['n']} completions x <= "
              f"{s['max_tokens']} tokens, {args.threads} threads, steps {args.warmup + 1}..{args.steps}")
        print(f"  torchrlhf : median {statistics.median(ours):6.2f} s/step  (all: {[round(t, 2) for t in ours]}; "
              f"process wall {t1 - t0:.0f} s; mean prompt {_mean(our_prompt):.1f}, completion {_mean(our_len):.1f} "
              "tokens)")
        print(f"  TRL       : median {statistics.median(theirs):6.2f} s/step  (all: {[round(t, 2) for t in theirs]}; "
              f"process wall {t2 - t1:.0f} s; mean prompt {their_prompt[0]:.1f} (data file), completion "
              f"{_mean(their_len):.1f} tokens)")
        print(f"  speed-up  : {statistics.median(theirs) / statistics.median(ours):.2f}x", flush=True)


if __name__ == "__main__":
    main()
