"""Seconds per GRPO step: the torchrlhf recipe vs TRL's `GRPOTrainer`, same model, data, sizes, same machine.

Both sides: SmolLM2-135M-Instruct (fp32), per step ``prompts`` prompts with ``n`` completions each of at most
``max_tokens`` tokens (EOS ends a completion early on both), sampled at temperature 1, one optimizer step per
rollout, no KL term (no reference model), the same chat template and no system prompt of ours,
``--threads`` torch threads, one process. Settings (``--settings``):

- ``arithmetic``: recipes/data/arithmetic_train.jsonl, 2 prompts x 4 x 32 tokens (short prompts);
- ``arithmetic8``: the same data, 8 prompts x 4 x 64 tokens;
- ``gsm8k``: data/gsm8k/gsm8k_train.jsonl (``tools/prepare_gsm8k.py``), 8 prompts x 8 x 64 tokens.

- ``learn`` (time to accuracy): the learning config (recipes/configs/grpo_arithmetic_learn.yaml: 8 prompts x 8,
  <= 20 tokens, temperature 0.7, its system prompt, lr 1e-5, KL loss 0.001 (k3), bf16 compute with fp32
  master weights) on both sides, each run until its held-out greedy accuracy (the config's 256 validation
  problems, checked every ``--eval-every`` steps and before the first) reaches ``--target``, for at most
  ``--max-steps``. Prints both accuracy curves, the training seconds (the steps' own time; validation
  excluded on both sides) to the first check at or above the target, and their ratio.

``--prompts/--n/--max-tokens`` override every chosen step-time setting. Each side runs in its own subprocess,
one after the other; the first ``--warmup`` steps are excluded. Both sides' mean prompt and completion
tokens are printed, so that equal work is visible. Needs ``pip install -e ".[bench]"`` (TRL).

    python tools/bench/bench_vs_trl.py [--settings arithmetic gsm8k --steps 5 --warmup 1 --threads 2]
    python tools/bench/bench_vs_trl.py --settings learn [--target 0.6 --max-steps 30 --eval-every 5]
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

from torchrlhf.models import smollm2_model_dir

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "arithmetic": dict(config="grpo_arithmetic_cpu.yaml", data="recipes/data/arithmetic_train.jsonl",
                       reward="arithmetic", prompt_len=64, prompts=2, n=4, max_tokens=32),
    "arithmetic8": dict(config="grpo_arithmetic_cpu.yaml", data="recipes/data/arithmetic_train.jsonl",
                        reward="arithmetic", prompt_len=64, prompts=8, n=4, max_tokens=64),
    "gsm8k": dict(config="grpo_gsm8k_smollm2.yaml", data="data/gsm8k/gsm8k_train.jsonl", reward="gsm8k",
                  prompt_len=256, prompts=8, n=8, max_tokens=64),
}


def run_recipe(config: str, overrides: list[str], out: Path, threads: int) -> list[dict]:
    """Run recipes/ppo.py with ``config`` (under recipes/configs) and ``overrides``; its metrics.jsonl rows."""
    cmd = [sys.executable, str(ROOT / "recipes/ppo.py"), "--config", str(ROOT / "recipes/configs" / config),
           *overrides, f"trainer.output_dir={out}", "trainer.loggers=[jsonl]"]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, cwd=ROOT, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"torchrlhf run failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_trl_script(script: str, argv: list[str], tag: str, threads: int):
    """Run a TRL ``script`` (``python -c``) with ``argv``; the JSON it printed after ``tag``."""
    proc = subprocess.run([sys.executable, "-c", script, *argv], env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                          cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{proc.stderr[-4000:]}")
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith(tag)).split(" ", 1)[1])


def run_torchrlhf(s: dict, args: argparse.Namespace, work: Path) -> tuple[list[float], list[float], list[float]]:
    out = work / "torchrlhf"
    b = s["prompts"] * s["n"]
    overrides = [
        f"data.train_files=[{s['data']}]", "data.val_files=[]", "data.system_prompt=null",
        f"data.max_prompt_length={s['prompt_len']}", f"data.train_batch_size={s['prompts']}", "data.shuffle=false",
        f"rollout.n={s['n']}", f"rollout.max_tokens={s['max_tokens']}", "rollout.temperature=1.0",
        "actor.dtype=float32", "actor.loss.use_kl_loss=false", f"actor.batching.ppo_mini_batch_size={s['prompts']}",
        f"actor.batching.ppo_micro_batch_size_per_device={b}", "actor.optim.lr=1e-6", "algorithm.use_kl_in_reward=false",
        f"rollout.engine.max_batch_size={b}", f"rollout.engine.max_seq_len={s['prompt_len'] + s['max_tokens']}",
        f"trainer.total_steps={args.steps}", "trainer.test_freq=0", "trainer.checkpoint.save_freq=0",
        "trainer.val_before_train=false",
    ]
    rows = [r for r in run_recipe(s["config"], overrides, out, args.threads) if "timing_s/step" in r]
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
    return run_trl_script(TRL_SCRIPT, [model_dir, str(ROOT / s["data"]), str(work / "trl"), str(args.steps),
                                       str(s["prompts"]), str(s["n"]), str(s["max_tokens"]), str(args.threads),
                                       s["reward"]], "STEP_TIMES", args.threads)


LEARN = dict(config="grpo_arithmetic_learn.yaml", train="recipes/data/arithmetic_train.jsonl",
             val="recipes/data/arithmetic_test.jsonl")


def learn_torchrlhf(args: argparse.Namespace, work: Path) -> tuple[list[float], dict[int, float]]:
    """The learning config as shipped, validated every ``eval_every`` steps: (step seconds, {step: accuracy})."""
    overrides = [f"trainer.total_steps={args.max_steps}", f"trainer.test_freq={args.eval_every}",
                 "trainer.val_before_train=true", "trainer.checkpoint.save_freq=0", "trainer.checkpoint.resume=disable"]
    rows = run_recipe(LEARN["config"], overrides, work / "torchrlhf", args.threads)
    times = [r["timing_s/step"] for r in sorted(rows, key=lambda r: r["step"]) if "timing_s/step" in r]
    acc = {r["step"]: r["val/arithmetic/acc"] for r in rows if "val/arithmetic/acc" in r}
    return times, acc


TRL_LEARN_SCRIPT = r"""
import json, sys, time
import torch
from datasets import Dataset
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from torchrlhf.rewards.arithmetic import compute_score

model_dir, config, train, val, out, max_steps, every, target, threads = sys.argv[1:10]
torch.set_num_threads(int(threads))
cfg = OmegaConf.load(config)
system = [{"role": "system", "content": cfg.data.system_prompt}]
rows = [json.loads(l) for l in open(train)]
ds = Dataset.from_list([{"prompt": system + r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])
val_rows = [json.loads(l) for l in open(val)][: cfg.data.val_max_samples]
tok = AutoTokenizer.from_pretrained(model_dir)
tok.padding_side = "left"

def reward(prompts, completions, ground_truth, **_):
    return [compute_score(c[0]["content"], g) for c, g in zip(completions, ground_truth)]

@torch.no_grad()
def accuracy(model):
    # Greedy over the validation problems, as the recipe's validation (bf16 autocast, as training computes).
    model.eval()
    right = 0
    for i in range(0, len(val_rows), cfg.data.val_batch_size):
        chunk = val_rows[i : i + cfg.data.val_batch_size]
        texts = [tok.apply_chat_template(system + r["prompt"], add_generation_prompt=True, tokenize=False)
                 for r in chunk]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            gen = model.generate(**enc, max_new_tokens=cfg.rollout.max_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id)
        outs = tok.batch_decode(gen[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        right += sum(compute_score(o, r["ground_truth"]) for o, r in zip(outs, chunk))
    model.train()
    return right / len(val_rows)

class ToAccuracy(TrainerCallback):
    def __init__(self):
        self.times, self.acc, self.t = [], {}, None
    def on_train_begin(self, args, state, control, model=None, **k):
        self.acc[0] = accuracy(model)
    def on_step_begin(self, *a, **k):
        self.t = time.perf_counter()
    def on_step_end(self, args, state, control, model=None, **k):
        self.times.append(time.perf_counter() - self.t)
        if state.global_step % int(every) == 0 or state.global_step == int(max_steps):
            self.acc[state.global_step] = accuracy(model)
            if self.acc[state.global_step] >= float(target):
                control.should_training_stop = True

cb = ToAccuracy()
b, n = cfg.data.train_batch_size * cfg.rollout.n, cfg.rollout.n
args = GRPOConfig(output_dir=out, per_device_train_batch_size=b, num_generations=n,
                  max_completion_length=cfg.rollout.max_tokens, max_steps=int(max_steps),
                  learning_rate=cfg.actor.optim.lr, beta=cfg.actor.loss.kl_loss_coef, temperature=cfg.rollout.temperature,
                  logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=True,
                  dataloader_num_workers=0, seed=0)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
            callbacks=[cb]).train()
print("LEARN", json.dumps([cb.times, cb.acc]))
"""


def learn_trl(args: argparse.Namespace, work: Path, model_dir: str) -> tuple[list[float], dict[int, float]]:
    times, acc = run_trl_script(
        TRL_LEARN_SCRIPT, [model_dir, str(ROOT / "recipes/configs" / LEARN["config"]), str(ROOT / LEARN["train"]),
                           str(ROOT / LEARN["val"]), str(work / "trl"), str(args.max_steps), str(args.eval_every),
                           str(args.target), str(args.threads)], "LEARN", args.threads)
    return times, {int(k): v for k, v in acc.items()}


def time_to(target: float, times: list[float], acc: dict[int, float]) -> tuple[int, float] | None:
    """(first checked step at or above ``target``, training seconds of the steps up to it), or None."""
    for step in sorted(acc):
        if acc[step] >= target:
            return step, sum(times[:step])
    return None


def learn_main(args: argparse.Namespace, model_dir: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"torchrlhf": learn_torchrlhf(args, Path(tmp)), "TRL": learn_trl(args, Path(tmp), model_dir)}
    print(f"[learn] time to {args.target:.0%} held-out greedy accuracy: {LEARN['config']} on both sides, "
          f"{args.threads} threads, checked every {args.eval_every} steps, at most {args.max_steps}")
    reached = {}
    for name, (times, acc) in sides.items():
        curve = ", ".join(f"{step}: {100 * a:.1f}%" for step, a in sorted(acc.items()))
        reached[name] = time_to(args.target, times, acc)
        got = (f"reached at step {reached[name][0]} after {reached[name][1]:.0f} s of training"
               if reached[name] else "not reached")
        print(f"  {name:<10}: median {statistics.median(times):6.2f} s/step; accuracy {curve}; {got}")
    if all(reached.values()):
        print(f"  speed-up to {args.target:.0%}: {reached['TRL'][1] / reached['torchrlhf'][1]:.2f}x", flush=True)


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=["arithmetic", "gsm8k"], choices=[*SETTINGS, "learn"])
    p.add_argument("--target", type=float, default=0.6, help="learn: the held-out accuracy to reach")
    p.add_argument("--max-steps", type=int, default=30, help="learn: steps at most per side")
    p.add_argument("--eval-every", type=int, default=5, help="learn: steps between accuracy checks")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompts", type=int, help="prompts per step (overrides the settings')")
    p.add_argument("--n", type=int, help="completions per prompt (overrides the settings')")
    p.add_argument("--max-tokens", type=int, help="(overrides the settings')")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    try:  # imported here: TRL is optional (the bench extra); it runs in the child scripts, this only checks
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit('TRL is not installed: pip install -e ".[bench]"') from None
    model_dir = str(smollm2_model_dir())
    for name in args.settings:
        if name == "learn":
            learn_main(args, model_dir)
            continue
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
