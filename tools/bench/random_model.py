"""A model directory with random weights for a shape's ``config.json``, built on the device, for GPU timing.

    python tools/bench/random_model.py tools/bench/shapes/qwen3-moe-1b-active /tmp/models/moe-1b \
        --tokenizer /tmp/models/1b --device cuda

The GPU kit's ``mkmodels.py`` makes the dense Llama shapes; this makes any architecture transformers builds from a
config, in bf16, seeded, with a tokenizer's files copied beside it (``--tokenizer``: a model directory or the kit's
``$GPU_TOKENIZER``). Building on the GPU takes seconds where ``model_path: random:<dir>`` (float32, on the host)
would take minutes for billions of parameters. Random weights earn no reward: they time, they do not learn.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer", "special_tokens", "generation_config", "chat_template")


def make(shape: Path, out: Path, tokenizer: Path | None, device: str, dtype: torch.dtype, seed: int = 0) -> int:
    """Write the model (safetensors, config) and the tokenizer's files into ``out``; returns its parameter count."""
    config = AutoConfig.from_pretrained(str(shape))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        for f in tokenizer.iterdir():
            if f.is_file() and f.name.startswith(TOKENIZER_FILES):
                shutil.copy(f, out / f.name)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", type=Path, help="a directory with the config.json to build")
    parser.add_argument("out", type=Path, help="the model directory to write")
    parser.add_argument("--tokenizer", type=Path, help="a directory whose tokenizer files are copied beside it")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    n = make(args.shape, args.out, args.tokenizer, args.device, getattr(torch, args.dtype))
    print(f"{args.shape.name}: {n / 1e6:.1f} M parameters -> {args.out}", flush=True)


if __name__ == "__main__":
    main()
