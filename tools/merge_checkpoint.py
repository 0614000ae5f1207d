"""Export a DCP training checkpoint to a HF directory (safetensors + config + tokenizer).

    python tools/merge_checkpoint.py --checkpoint CKPT_DIR --base HF_DIR --out OUT_DIR [--head value] [--dtype bf16]

`CKPT_DIR` is what `torchrlhf.utils.checkpoint.save_checkpoint` wrote: DCP with the
model's state dict under the "model." prefix (optimizer entries are ignored), saved on
any number of ranks. `HF_DIR` is the model the run started from; it gives the config,
tokenizer and generation config. The weights are read into a model built from that
config on one process (no torch.distributed needed), then saved with
`save_pretrained`. `--head value` exports a critic / reward model (`ValueModel`) as
`AutoModelForTokenClassification` with num_labels=1 (same `model.*`/`score.*` names).
The output directory is written atomically (tmp dir + rename).
"""

from __future__ import annotations

import argparse
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, GenerationConfig

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def _build(base: Path, head: str | None) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(str(base))
    with torch.device("meta"):
        if head == "value":
            config.num_labels = 1
            model = AutoModelForTokenClassification.from_config(config)
        else:
            model = AutoModelForCausalLM.from_config(config)
    return model.to_empty(device="cpu")


def merge_checkpoint(
    checkpoint: str | os.PathLike,
    base: str | os.PathLike,
    out: str | os.PathLike,
    *,
    head: str | None = None,
    dtype: torch.dtype | None = None,
    prefix: str = "model.",
) -> Path:
    """Read the `prefix`-ed model weights of the DCP at `checkpoint` into the `base` architecture; save to `out`."""
    checkpoint, base, out = Path(checkpoint), Path(base), Path(out)
    if not (checkpoint / ".metadata").is_file():
        raise FileNotFoundError(f"{checkpoint} is not a DCP checkpoint (no .metadata file)")
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{base} is not a HF model directory (no config.json)")
    if head not in (None, "value"):
        raise ValueError(f"--head must be 'value' or omitted, got {head!r}")
    saved = set(FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)
    model = _build(base, head)
    sd = model.state_dict()
    wanted = {prefix + k: v for k, v in sd.items() if prefix + k in saved}
    missing = [k for k in sd if prefix + k not in saved]
    # A tied lm_head shares the embedding's storage: loading the embedding fills it.
    tied = {k for k in missing if k.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)}
    missing = [k for k in missing if k not in tied]
    if missing:
        have = sorted(k for k in saved if k.startswith(prefix))[:5]
        raise KeyError(f"{checkpoint}: no weights for {missing[:5]}{'...' if len(missing) > 5 else ''} "
                       f"under prefix {prefix!r} (checkpoint has e.g. {have})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns when it runs without a process group, which is the point here
        dcp.load(wanted, storage_reader=FileSystemReader(str(checkpoint)), no_dist=True)
    with torch.no_grad():
        for k, v in sd.items():  # DCP may hand back new tensors instead of filling ours in place
            loaded = wanted.get(prefix + k)
            if loaded is not None and loaded.data_ptr() != v.data_ptr():
                v.copy_(loaded)
    if dtype is not None:
        model.to(dtype)
        model.config.dtype = dtype

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if (base / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(str(base)).save_pretrained(tmp)
    if head is None and (base / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(str(base)).save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="DCP checkpoint directory (save_checkpoint output)")
    ap.add_argument("--base", required=True, help="HF directory the run started from (config + tokenizer)")
    ap.add_argument("--out", required=True, help="output HF directory")
    ap.add_argument("--head", choices=["value"], default=None, help="export a value/reward model")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast weights (default: as saved)")
    ap.add_argument("--prefix", default="model.", help="key prefix of the model state dict inside the DCP")
    args = ap.parse_args(argv)
    out = merge_checkpoint(args.checkpoint, args.base, args.out, head=args.head,
                           dtype=_DTYPES[args.dtype] if args.dtype else None, prefix=args.prefix)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
