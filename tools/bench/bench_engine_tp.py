"""Milliseconds per decode step of the native engine at TP 2 against TP 1, side by side in one run.

TP 1 runs in this process alone; TP 2 runs on two gloo processes, once with the engine's plain-tensor layout
(`models.parallelize.split_blocks_over_tp`) and once with the DTensor plan it used before (``parallelize_module``
with the training block plan: the same shards, each projection a DTensor op). Every engine generates the same
``--batch`` prompts of 16 tokens for ``--tokens`` tokens (EOS ignored), the best of ``--repeats`` after a warm-up.

    python tools/bench/bench_engine_tp.py [--model DIR] [--batch 32] [--tokens 24]

``--model``: an HF model directory (default: `save_tiny_model`'s, whose vocabulary is most of its FLOPs).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams
from torchrlhf.models import load_causal_lm, save_tiny_model


def ms_per_step(model_dir: str, batch: int, tokens: int, repeats: int, mesh=None) -> float:
    engine = NativeEngine(load_causal_lm(model_dir), max_batch_size=batch, max_seq_len=16 + tokens + 8, tp_mesh=mesh)
    ids = torch.randint(3, 1000, (batch, 16), generator=torch.Generator().manual_seed(0))
    prompts = Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    sampling = SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=1)
    engine.generate(prompts, sampling)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        engine.generate(prompts, sampling)
        best = min(best, time.perf_counter() - start)
    return best / tokens * 1e3


def _dtensor_blocks(model: torch.nn.Module, tp_mesh) -> None:
    """The engine's TP before `split_blocks_over_tp`: the training block plan applied with DTensor."""
    from torch.distributed.tensor.parallel import parallelize_module

    from torchrlhf.models.parallelize import BLOCK_TP_PLAN

    for i, layer in enumerate(model.model.layers):
        plan = {name: style() for name, style in BLOCK_TP_PLAN.items()
                if hasattr(layer.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])}
        parallelize_module(layer, tp_mesh, plan)


def _worker(rank: int, store: str, model_dir: str, batch: int, tokens: int, repeats: int, out: str) -> None:
    import torchrlhf.generation.engine as engine_module

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    mesh = dist.device_mesh.init_device_mesh("cpu", (2,))
    result = {"plain": ms_per_step(model_dir, batch, tokens, repeats, mesh)}
    engine_module.split_blocks_over_tp = _dtensor_blocks
    result["dtensor"] = ms_per_step(model_dir, batch, tokens, repeats, mesh)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or str(save_tiny_model(Path(tmp) / "tiny"))
        one = ms_per_step(model_dir, args.batch, args.tokens, args.repeats)
        out = os.path.join(tmp, "tp2.json")
        mp.spawn(_worker, args=(f"file://{tmp}/store", model_dir, args.batch, args.tokens, args.repeats, out),
                 nprocs=2, join=True)
        two = json.loads(Path(out).read_text())
    print(f"batch {args.batch}, {args.tokens} tokens, 1 thread per rank: ms per decode step")
    print(f"  TP 1                       {one:8.2f}")
    print(f"  TP 2, plain shards         {two['plain']:8.2f}  ({two['plain'] / one:.2f}x TP 1)")
    print(f"  TP 2, DTensor (baseline)   {two['dtensor']:8.2f}  ({two['dtensor'] / one:.2f}x TP 1)")
    print(f"  plain against DTensor: {two['dtensor'] / two['plain']:.2f}x faster")


if __name__ == "__main__":
    main()
