"""Everything we have for GPUs, in one command, on a machine with one CUDA GPU; one table at the end.

    python tools/gpu_check.py                   # all checks, within --budget-s seconds (default 570)
    python tools/gpu_check.py --only recipe     # some of them

Checks (each a subprocess, so one failing or hanging does not stop the others):

- ``cuda-tests``: the test files that need a CUDA device (CUDA-graph decode against eager decode and HF; the
  decode attention kernel against slot-by-slot attention, and graphed decode through it against HF;
  the optimizer state offloaded during generation, or kept with ``rollout.offload_optimizer: false``).
- ``generate``: the native engine's decode with CUDA graphs against HF ``generate`` and against itself
  without graphs (``tools/bench/bench_generate.py``, SmolLM2-shaped random weights, bf16).
- ``vllm``: the same bench with vLLM beside it, when vLLM imports with CUDA; skipped otherwise.
- ``decode-1b``: the native engine's decode of the 1.07 B shape (random weights) at batch 128, 256 tokens: tok/s
  and the fraction of the memory bound (weights + KV bytes per step at the measured copy bandwidth), with the
  decode step compiled (``NativeEngine(compile=True)``) against uncompiled, each engine's warm-up, and the
  uncompiled step with the decode attention kernel against SDPA.
- ``warmup`` (with ``--models DIR`` holding ``1b``): the decode-1b engine's warm-up (construction and first
  ``generate``, graphs captured) uncompiled, compiled against an empty compile cache, and compiled again in a
  fresh process that loads the saved step (``tools/bench/bench_warmup.py``): the second compiled warm-up over
  the uncompiled one is issue 60's ``<= 1.3x`` target.
- ``agent`` (with ``--models DIR`` holding ``smol``): multi-turn agent decode (turns of about 25 tokens, 64
  trajectories) against single-turn decode on the same engine and batch (``tools/bench/bench_agent.py``).
- ``recipe`` and ``actor-update``: the GRPO recipe at world size 1 on SmolLM2-135M for a few steps with a
  bf16 FSDP2 actor (``actor-update`` reports that run's actor update: its time and gradient norm).
- ``train-1b``, ``train-3b``, ``train-1b-lora`` (with ``--models DIR`` holding random-weight models ``1b``
  and ``3b``, e.g. made by the GPU kit's ``mkmodels.py``): the GRPO recipe at world size 1, 16 prompts x 8
  samples of <= 64 prompt + 256 response tokens, bf16 actor and reference, LoRA rank 16 on the ``-lora`` row,
  compiled blocks and decode step (``actor.compile``, ``rollout.engine.compile``) on the ``-compile`` rows,
  ``-compile-resident`` also with ``rollout.offload_optimizer: false`` (its step time against ``-compile``'s is
  what moving the optimizer state to the host and back costs), ``-offload`` with
  ``actor.memory.offload_prefix_activations`` (its peak memory against ``train-1b``'s).
  ``train-moe-1b``: a random Qwen3-MoE with the ``1b`` shape's 1.07 B active parameters (3.49 B in all,
  ``tools/bench/shapes/qwen3-moe-1b-active``), which the ``make-moe-1b`` check builds on the GPU into
  ``--models`` (``tools/bench/random_model.py``) when it is missing; its MFU counts the active parameters.
  Figures: the last step's time and its actor update time, ``perf/mfu/actor`` and ``perf/mfu/ref``, the peak allocated
  memory against the dry run's estimate. ``--profile-dir DIR`` also records the step before the last with
  ``trainer.profile`` (``DIR/<check>/step_N/<role>_rank0.{json,txt}``).

Without a CUDA device it says so, lists the checks it skipped and exits 0. Otherwise it exits 1 if a check
failed. Paste the table, with its header line (device, date, commit), into docs/performance.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from torchrlhf.generation import vllm_available

ROOT = Path(__file__).resolve().parents[1]
# Test files with tests that skip without CUDA (tests/tools/test_gpu_check.py keeps this list complete).
CUDA_TESTS = ["tests/generation/test_cuda_graphs.py", "tests/generation/test_decode_attention.py",
              "tests/hybrid/test_mode_cuda.py"]
BENCH = ["tools/bench/bench_generate.py", "--device", "cuda", "--dtype", "bfloat16", "--shape", "smol",
         "--batch-sizes", "1", "16", "64", "--max-new-tokens", "64", "--repeats", "1"]
# issue 38's target row: the 1.07 B shape's decode at batch 128, 256 tokens, against the memory bound
DECODE_1B = ["tools/bench/bench_generate.py", "--device", "cuda", "--dtype", "bfloat16", "--shape", "1b",
             "--batch-sizes", "128", "--max-new-tokens", "256", "--repeats", "2", "--skip-hf", "--compile",
             "--sdpa-too"]
# issue 38's agent row: multi-turn decode against single-turn on the same engine and batch (random smol weights)
AGENT = ["tools/bench/bench_agent.py", "--device", "cuda", "--dtype", "bfloat16", "--trajectories", "64", "--n", "1",
         "--turns", "8", "--stop-every", "25", "--max-tokens", "256", "--repeats", "2"]
# issue 60's warm-up row: the decode-1b engine's first generate, uncompiled, compiled, and compiled again (loaded)
WARMUP = ["tools/bench/bench_warmup.py", "--parts", "decode", "--device", "cuda", "--dtype", "bfloat16", "--batch", "128",
          "--new-tokens", "256"]
RECIPE_STEPS = 3
# name -> (model folder under --models, micro-batch, extra overrides): the training rows (issue figures' shapes)
TRAIN_ROWS = {
    "train-1b": ("1b", 16, []),
    "train-1b-compile": ("1b", 16, ["actor.compile=true", "rollout.engine.compile=true"]),
    # the same with the optimizer state kept on the GPU during generation: what offloading it costs a step
    "train-1b-compile-resident": ("1b", 16, ["actor.compile=true", "rollout.engine.compile=true",
                                             "rollout.offload_optimizer=false"]),
    "train-1b-lora": ("1b", 16, ["actor.lora.rank=16", "actor.lora.alpha=32"]),
    # the prompt pass's activations in host memory: its peak against train-1b's (prompts here are short, <= 64)
    "train-1b-offload": ("1b", 16, ["actor.memory.offload_prefix_activations=true"]),
    "train-3b": ("3b", 8, []),
    # a mixture of experts with the 1b shape's 1.07 B active parameters (3.49 B in all: 32 experts, top-8), built by
    # the make-moe-1b check; the decode step eager (CUDA-graph capture of the routed experts is not tested)
    "train-moe-1b": ("moe-1b", 16, ["rollout.engine.cuda_graphs=false"]),
}
MOE_SHAPE = "tools/bench/shapes/qwen3-moe-1b-active"  # train-moe-1b's config.json


def train_overrides(model_dir: str, micro: int, output_dir: str) -> list[str]:
    """The training rows' recipe: GRPO, world size 1, 128 samples of <= 64 + 256 tokens, bf16."""
    return [f"model_path={model_dir}", "actor.dtype=bfloat16", "data.train_batch_size=16", "rollout.n=8",
            "rollout.max_tokens=256", "rollout.engine.max_batch_size=128", "rollout.engine.max_seq_len=320",
            "data.max_prompt_length=64", "actor.batching.ppo_mini_batch_size=16",
            f"actor.batching.ppo_micro_batch_size_per_device={micro}", f"trainer.total_steps={RECIPE_STEPS}",
            "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.checkpoint.save_freq=0", "trainer.checkpoint.resume=disable",
            f"trainer.output_dir={output_dir}", "trainer.loggers=[console,jsonl]"]


@dataclass
class Check:
    name: str
    what: str
    command: list[str]
    timeout_s: float


@dataclass
class Result:
    name: str
    result: str  # "pass", "FAIL (...)", "skipped (...)"
    figure: str = ""


def checks(output_dir: str, vllm_ok: bool, models: str | None = None, profile_dir: str | None = None) -> list[Check]:
    """The checks to run; each recipe run writes into ``output_dir/<check name>``."""
    py = sys.executable
    recipe = [py, "recipes/ppo.py", "--config", "recipes/configs/grpo_arithmetic_cpu.yaml",
              f"trainer.total_steps={RECIPE_STEPS}", f"trainer.output_dir={os.path.join(output_dir, 'recipe')}",
              "trainer.checkpoint.resume=disable",
              "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.checkpoint.save_freq=0",
              "trainer.loggers=[console,jsonl]", "actor.dtype=bfloat16"]
    found = [
        Check("cuda-tests", "the CUDA tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", *CUDA_TESTS], 240),
        Check("generate", "native decode with CUDA graphs vs HF generate", [py, *BENCH], 180),
        Check("decode-1b", "native decode, 1.07 B shape, batch 128, 256 tokens", [py, *DECODE_1B], 360),
        Check("recipe", f"GRPO recipe, world size 1, SmolLM2, {RECIPE_STEPS} steps", recipe, 300),
    ]
    if vllm_ok:
        found.insert(2, Check("vllm", "the same bench with vLLM beside it", [py, *BENCH, "--vllm"], 240))
    if models is not None and (Path(models) / "1b").is_dir():
        found.append(Check("warmup", "decode-1b engine warm-up: uncompiled, compiled, compiled again (loaded)",
                           [py, *WARMUP, "--model", str(Path(models) / "1b")], 360))
    if models is not None and (Path(models) / "smol").is_dir():
        found.append(Check("agent", "multi-turn agent decode vs single-turn, smol shape, 64 trajectories",
                           [py, *AGENT, "--model", str(Path(models) / "smol")], 240))
    if models is not None and (Path(models) / "1b").is_dir() and not (Path(models) / "moe-1b").is_dir():
        found.append(Check("make-moe-1b", "random-weight MoE model, 1.07 B of 3.49 B parameters active",
                           [py, "tools/bench/random_model.py", MOE_SHAPE, str(Path(models) / "moe-1b"),
                            "--tokenizer", str(Path(models) / "1b"), "--device", "cuda"], 180))
    made = {c.name.removeprefix("make-") for c in found if c.name.startswith("make-")}
    for name, (shape, micro, extra) in TRAIN_ROWS.items():
        if models is None or not ((Path(models) / shape).is_dir() or shape in made):
            continue
        command = [py, "recipes/ppo.py", "--config", "recipes/configs/grpo_arithmetic_cpu.yaml",
                   *train_overrides(str(Path(models) / shape), micro, os.path.join(output_dir, name)), *extra]
        if profile_dir:
            # the step before the last: the figures come from the last, which the profiler does not slow
            command += [f"trainer.profile.steps=[{RECIPE_STEPS - 1}]", f"trainer.profile.dir={profile_dir}/{name}"]
        found.append(Check(name, f"GRPO update, {shape} shape, micro {micro}" + (f", {' '.join(extra)}" if extra else ""),
                           command, 360))
    return found


def _figure_of_training(output_dir: str, estimate_gib: float | None) -> str:
    """The last step's update time, actor and ref MFU, and peak memory against the dry run's estimate."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return ""
    last = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][-1]
    text = (f"step {last.get('timing_s/step', 0):.2f} s, update {last['timing_s/update_actor']:.2f} s, MFU actor {100 * last.get('perf/mfu/actor', 0):.1f} %, "
            f"ref {100 * last.get('perf/mfu/ref', 0):.1f} %, gen {last.get('timing_s/gen', 0):.2f} s, "
            f"peak {last.get('perf/max_memory_allocated_gb', 0):.1f} GiB")
    if estimate_gib is not None:
        text += f" (estimate {estimate_gib:.1f} GiB)"
    return text


def dry_run_estimate(command: list[str], timeout: float = 300) -> float | None:
    """The dry run's memory estimate for rank 0 of a recipe command (GiB), or None if it did not print one in
    ``timeout`` seconds."""
    if timeout < 10:
        return None
    try:
        p = subprocess.run([*command, "--dry-run", "--world-size", "1"], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    found = re.search(r"^\s*rank 0: ([\d.]+) GiB", p.stdout, re.MULTILINE)
    return float(found.group(1)) if found else None


def _figure_of_bench(out: str, vllm: bool) -> str:
    """The largest batch's row of bench_generate's table: native tok/s, x HF, x without graphs (x vLLM)."""
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s*\d+\s+\d", line)]
    if not rows:
        return ""
    r = rows[-1]
    text = f"batch {r[0]}: {float(r[1]):.0f} tok/s, {r[3]}x HF, {r[5]}x without graphs"
    if vllm and len(r) >= 10:
        text += f", {r[7]}x vLLM"
    if "compiled/uncompiled" in out:  # --compile: the native column is the compiled step
        text += f", compiled {r[7]}x uncompiled"
    warm = re.findall(r"warm-up of (\w+) .*: ([\d.]+) s", out)
    if warm:
        text += ", warm-up " + ", ".join(f"{name} {sec} s" for name, sec in warm)
    text += f", {float(r[-1]):.0%} of the memory bound"
    attention = re.search(r"decode attention at batch \d+, \w+ step: (.*)$", out, re.MULTILINE)
    return text + (f"; {attention.group(1)}" if attention else "")


def _figure_of_agent(out: str) -> str:
    """Agent and single-turn tok/s and their ratio (bench_agent's table)."""
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("native")}
    ratio = re.search(r"agent / single-turn = ([\d.]+)x", out)
    if "native" not in rows or "native-single" not in rows or not ratio:
        return ""
    steps = re.search(r"decode steps of the last native run: (\d+) decode, (\d+) of them riding observations, (\d+) extends of "
                      r"their own; single-turn: (\d+) decode", out)
    text = (f"agent {float(rows['native'][2]):.0f} tok/s ({rows['native'][3]} turns), single-turn "
            f"{float(rows['native-single'][2]):.0f} tok/s: {ratio.group(1)}x")
    if steps:
        text += (f"; decode steps {steps.group(1)} ({steps.group(2)} riding, eager; {steps.group(3)} extends) against "
                 f"{steps.group(4)} single-turn")
    return text


def _figure_of_warmup(out: str) -> str:
    """bench_warmup's three warm-ups and its ratio (second compiled / uncompiled)."""
    runs = dict(re.findall(r"^\s+(uncompiled|first compiled|second compiled)\s+([\d.]+)\s", out, re.MULTILINE))
    ratio = re.search(r"ratio ([\d.]+)x", out)
    if len(runs) != 3 or not ratio:
        return ""
    return (f"warm-up uncompiled {runs['uncompiled']} s, compiled {runs['first compiled']} s, compiled again "
            f"{runs['second compiled']} s: {ratio.group(1)}x")


def _figures_of_recipe(output_dir: str) -> tuple[str, str]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return "", ""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if len(rows) != RECIPE_STEPS:
        return f"{len(rows)} of {RECIPE_STEPS} steps logged", ""
    last = rows[-1]
    step = f"{last['timing_s/step']:.2f} s/step (step {RECIPE_STEPS}), score {last['critic/score/mean']:.3f}"
    update = f"{last['timing_s/update_actor']:.2f} s, grad norm {last['actor/grad_norm']:.3g}"
    return step, update


def run(check: Check, budget_left: float) -> tuple[str, str, float]:
    """(result, output, seconds)."""
    timeout = min(check.timeout_s, budget_left)
    if timeout < 10:
        return "skipped (out of time budget)", "", 0.0
    start = time.monotonic()
    try:
        p = subprocess.run(check.command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return f"FAIL (timed out after {timeout:.0f} s)", out, time.monotonic() - start
    seconds = time.monotonic() - start
    if p.returncode != 0:
        tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
        return f"FAIL (exit {p.returncode}: {tail[0][:80]})", p.stdout + p.stderr, seconds
    return "pass", p.stdout + (f"\n--- stderr ---\n{p.stderr}" if p.stderr else ""), seconds


def table(results: list[Result]) -> str:
    rows = [("check", "result", "figure")] + [(r.name, r.result, r.figure) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None,
                        help="run these checks only, in this order (cuda-tests, generate, vllm, decode-1b, warmup, agent, recipe, "
                             "actor-update, train-1b, train-1b-compile, train-1b-lora, train-3b, train-moe-1b)")
    parser.add_argument("--budget-s", type=float, default=570.0, help="stop starting checks after this many seconds")
    parser.add_argument("--models", default=None, help="a folder with random-weight models 1b and 3b (training rows); "
                        "moe-1b is made there from 1b's tokenizer when missing")
    parser.add_argument("--profile-dir", default=None, help="record the training rows' last step there")
    parser.add_argument("--log-dir", default=None, help="write each check's whole output to DIR/<check>.log")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        if not torch.cuda.is_available():
            built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "built without CUDA"
            print(f"gpu_check: no CUDA device (torch {torch.__version__}, {built}); nothing was run.")
            print("skipped checks:")
            for c in checks(tmp, vllm_ok=True):
                command = " ".join("python" if a == sys.executable else a for a in c.command)
                print(f"  {c.name:<12} {c.what}: {command}")
            print("  actor-update bf16 FSDP2 actor update (measured in the recipe run)")
            return 0
        vllm_ok, why = vllm_available()
        todo = checks(tmp, vllm_ok, args.models, args.profile_dir)
        wanted = set(args.only or [])
        if "actor-update" in wanted:
            wanted.add("recipe")
        if "train-moe-1b" in wanted:
            wanted.add("make-moe-1b")
        if wanted:  # in the order asked for (the most wanted first, in case the budget runs out)
            order = [*(["make-moe-1b"] if "make-moe-1b" in wanted else []), *args.only,
                     *(["recipe"] if "actor-update" in wanted and "recipe" not in args.only else [])]
            todo = sorted((c for c in todo if c.name in wanted), key=lambda c: order.index(c.name))
        device = torch.cuda.get_device_name(0)
        header = (f"gpu_check on {device}, {datetime.date.today().isoformat()}, commit {_commit()}, "
                  f"torch {torch.__version__}")
        print(header, flush=True)
        start, results = time.monotonic(), []
        for check in todo:
            result, out, seconds = run(check, args.budget_s - (time.monotonic() - start))
            print(f"  {check.name}: {result} ({seconds:.0f} s)", flush=True)
            if args.log_dir:
                Path(args.log_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.log_dir) / f"{check.name}.log").write_text(out)
            if check.name == "cuda-tests":
                counts = re.findall(r"\d+ (?:passed|failed|skipped)", out)
                results.append(Result(check.name, result, ", ".join(counts)))
            elif check.name == "agent":
                results.append(Result(check.name, result, _figure_of_agent(out)))
            elif check.name == "warmup":
                results.append(Result(check.name, result, _figure_of_warmup(out)))
            elif check.name in ("generate", "vllm", "decode-1b"):
                results.append(Result(check.name, result, _figure_of_bench(out, check.name == "vllm")))
            elif check.name.startswith("make-"):
                results.append(Result(check.name, result))
            elif check.name in TRAIN_ROWS:
                estimate = dry_run_estimate([a for a in check.command if not a.startswith("trainer.profile")],
                                            min(300.0, args.budget_s - (time.monotonic() - start)))
                results.append(Result(check.name, result, _figure_of_training(os.path.join(tmp, check.name), estimate)))
            else:
                step, update = _figures_of_recipe(os.path.join(tmp, "recipe")) if result == "pass" else ("", "")
                results.append(Result("recipe", result, step))
                results.append(Result("actor-update", result, update))
        if not vllm_ok and (not wanted or "vllm" in wanted):
            results.append(Result("vllm", f"skipped ({why})"))
        print(header)
        print(table(results))
        return 1 if any(r.result.startswith("FAIL") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
