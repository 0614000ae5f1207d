"""Warm-up of the compiled paths, first run against second run on one machine, each run in a fresh process.

Three runs per part, each a new Python process:

- ``uncompiled``: the part's first call without ``torch.compile``;
- ``first compiled``: with compilation, against an empty compile cache (`torchrlhf.utils.compile_cache`);
- ``second compiled``: the same again, reading the cache the first run wrote.

Parts (SmolLM2-135M's architecture with random weights, fp32, unless ``--model``, ``--device`` and ``--dtype``
say otherwise; a CUDA device runs the decode part only, its first ``generate`` capturing the CUDA graphs):

- ``decode``: `NativeEngine(compile=True)` built, then its first ``generate`` (``--batch`` prompts x
  ``--new-tokens`` tokens; the compiled decode step, ``rollout.engine.compile``);
- ``blocks``: `ActorWorker(compile=True)` built, then its first ``update`` on the learning config's update shape
  (``actor.compile``: each block and the head's tile arithmetic through ``torch.compile``).

The agents' riding step (an observation prefilled in a decode step's forward) runs eagerly even where decode is
compiled, so it has no compile warm-up to measure. Each part prints the three warm-ups, the steady time of a
second call in each run, and ``ratio N.NNx``: second compiled warm-up / uncompiled warm-up.

    python tools/bench/bench_warmup.py [--parts decode blocks] [--threads 2]
    python tools/bench/bench_warmup.py --parts decode --device cuda --dtype bfloat16 --model DIR --batch 128 \
        --new-tokens 256    # tools/gpu_check.py's warmup row
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_generate import _sync, make_prompts, random_model  # noqa: E402
from bench_train import SHAPES, actor_step, group_rollouts, shape_batch  # noqa: E402

RUNS = ("uncompiled", "first compiled", "second compiled")


def decode_part(path: str, compile: bool, args: argparse.Namespace) -> tuple[float, float]:
    from torchrlhf.generation import NativeEngine, SamplingParams

    device = torch.device(args.device)
    start = time.perf_counter()
    engine = NativeEngine(path, max_batch_size=args.batch, max_seq_len=64 + args.new_tokens, prefix_cache=False,
                          compile=compile, device=device, dtype=getattr(torch, args.dtype))
    prompts = make_prompts(None, args.batch, device)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=args.new_tokens, ignore_eos=True)
    engine.generate(prompts, params)
    _sync(device)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    engine.generate(prompts, params)
    _sync(device)
    return warmup, time.perf_counter() - start


def blocks_part(path: str, compile: bool, args: argparse.Namespace) -> tuple[float, float]:
    shape = SHAPES["learn"]
    batch = group_rollouts(**shape_batch(shape), vocab=49152)
    start = time.perf_counter()
    step = actor_step(path, batch, shape["micro"], shared=True, compile=compile)
    step()
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    step()
    return warmup, time.perf_counter() - start


PARTS = {"decode": decode_part, "blocks": blocks_part}


def child(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    warmup, steady = PARTS[args.child](args.model, args.compile, args)
    print(json.dumps({"warmup": warmup, "steady": steady}))


def run_child(part: str, model: str, compile: bool, cache: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", part, "--model", model, "--threads", str(args.threads),
           "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--device", args.device,
           "--dtype", args.dtype] + (["--compile"] if compile else [])
    env = dict(os.environ, TORCHRLHF_COMPILE_CACHE=cache, OMP_NUM_THREADS=str(args.threads))
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{part} ({'compiled' if compile else 'uncompiled'}) failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", choices=sorted(PARTS), default=["decode", "blocks"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="decode: prompts per generate")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode: tokens per prompt")
    parser.add_argument("--device", default="cpu", help="decode: the engine's device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="decode: the engine's dtype")
    parser.add_argument("--model", help="decode: a model folder to load (default: SmolLM2's shape, random weights)")
    parser.add_argument("--child", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.device != "cpu" and args.parts != ["decode"]:
        parser.error("on a device other than the CPU, only --parts decode runs")
    what = args.model or "SmolLM2-135M shape, random weights"
    print(f"torch {torch.__version__}, {args.device}, {args.threads} threads; {what}, {args.dtype}")
    with tempfile.TemporaryDirectory(prefix="bench_warmup_") as tmp:
        model = args.model or str(Path(tmp) / "model")
        if args.model is None:
            random_model("smol", model, torch.float32)
        for part in args.parts:
            cache = str(Path(tmp) / f"cache_{part}")  # empty for the first compiled run
            runs = {"uncompiled": run_child(part, model, False, cache, args)}
            runs["first compiled"] = run_child(part, model, True, cache, args)
            runs["second compiled"] = run_child(part, model, True, cache, args)
            print(f"\n{part}: {'run':>16} {'warm-up s':>10} {'steady s':>9}")
            for name in RUNS:
                print(f"{'':{len(part) + 1}} {name:>16} {runs[name]['warmup']:>10.1f} {runs[name]['steady']:>9.2f}")
            ratio = runs["second compiled"]["warmup"] / runs["uncompiled"]["warmup"]
            first = runs["first compiled"]["warmup"] / runs["uncompiled"]["warmup"]
            print(f"{part}: first compiled / uncompiled {first:.2f}x; second compiled / uncompiled: ratio {ratio:.2f}x")


if __name__ == "__main__":
    main()
