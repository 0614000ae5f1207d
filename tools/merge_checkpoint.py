"""Export a DCP training checkpoint to a HF directory (safetensors + config + tokenizer).

    python tools/merge_checkpoint.py --checkpoint CKPT_DIR --base HF_DIR --out OUT_DIR [--head value] [--dtype bf16]
    python tools/merge_checkpoint.py --checkpoint CKPT_DIR --base HF_DIR [--out OUT_DIR] [--adapter-out PEFT_DIR]

`CKPT_DIR` is what `torchrlhf.utils.checkpoint.save_checkpoint` wrote: DCP with the
model's state dict under the "model." prefix (optimizer entries are ignored), saved on
any number of ranks. `HF_DIR` is the model the run started from; it gives the config,
tokenizer and generation config. The weights are read into a model built from that
config on one process (no torch.distributed needed), then saved with
`save_pretrained`. `--head value` exports a critic / reward model (`ValueModel`) as
`AutoModelForTokenClassification` with num_labels=1 (same `model.*`/`score.*` names).
The output directory is written atomically (tmp dir + rename).

A LoRA actor's checkpoint holds its adapters only (``*.lora_A`` / ``*.lora_B``, config in ``state.pt``).
`--out` then gets the base model with the adapters merged in (``W + alpha/r · B @ A``, a plain HF model),
and `--adapter-out` a PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained(base_model, PEFT_DIR)`` loads onto the base.
"""

from __future__ import annotations

import argparse
import os
import shutil
import warnings
from pathlib import Path

import json

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, GenerationConfig

from torchrlhf.models.lora import LoRAConfig, adapter_modules, is_adapter, peft_adapter_config, peft_key

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
    if any(k.startswith(prefix) and is_adapter(k) for k in saved):
        raise ValueError(f"{checkpoint} holds LoRA adapters only: export it with merge_lora_checkpoint "
                         "(the command line does so by itself)")
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
    return _save_hf(model, base, out, with_generation_config=head is None)


def _save_hf(model: torch.nn.Module, base: Path, out: Path, with_generation_config: bool = True) -> Path:
    """``model`` with the base's tokenizer (and generation config) as a HF directory, written atomically."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if (base / "tokenizer_config.json").is_file():
            AutoTokenizer.from_pretrained(str(base)).save_pretrained(tmp)
        if with_generation_config and (base / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(str(base)).save_pretrained(tmp)

    return _atomic_dir(out, write)


def _atomic_dir(out: Path, write) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out


def read_adapters(checkpoint: str | os.PathLike, prefix: str = "model.") -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """(the LoRA config, adapter name -> full tensor) of a LoRA actor's DCP checkpoint, on one process."""
    checkpoint = Path(checkpoint)
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    keys = [k for k in metadata if k.startswith(prefix) and is_adapter(k)]
    if not keys:
        raise ValueError(f"{checkpoint} holds no LoRA adapters (a full-model checkpoint: use merge_checkpoint)")
    extra = torch.load(checkpoint / "state.pt", weights_only=True).get("extra", {})
    if "lora" not in extra:
        raise ValueError(f"{checkpoint}/state.pt does not record the LoRA config (alpha) the adapters were trained with")
    tensors = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group on purpose
        dcp.load(tensors, storage_reader=FileSystemReader(str(checkpoint)), no_dist=True)
    return LoRAConfig(**extra["lora"]), {k[len(prefix):]: v for k, v in tensors.items()}


def merge_lora_checkpoint(
    checkpoint: str | os.PathLike,
    base: str | os.PathLike,
    out: str | os.PathLike | None = None,
    *,
    adapter_out: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
    prefix: str = "model.",
) -> tuple[Path | None, Path | None]:
    """A LoRA checkpoint as a merged HF directory (``out``) and/or a PEFT adapter directory (``adapter_out``)."""
    base = Path(base)
    if out is None and adapter_out is None:
        raise ValueError("give --out (merged HF model) and/or --adapter-out (PEFT adapter)")
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"{base} is not a HF model directory (no config.json)")
    config, adapters = read_adapters(checkpoint, prefix)
    modules = adapter_modules(adapters)
    merged_dir = peft_dir = None
    if out is not None:
        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        weights = dict(model.named_parameters())
        with torch.no_grad():
            for module in modules:
                w = weights.get(f"{module}.weight")
                if w is None:
                    raise KeyError(f"the base model {base} has no {module}.weight for the checkpoint's adapter")
                w.addmm_(adapters[f"{module}.lora_B"].float(), adapters[f"{module}.lora_A"].float(),
                         alpha=config.scaling)
        if dtype is not None:
            model.to(dtype)
            model.config.dtype = dtype
        merged_dir = _save_hf(model, base, Path(out))
    if adapter_out is not None:
        tensors = {peft_key(n): (t.to(dtype) if dtype is not None else t).contiguous() for n, t in adapters.items()}

        def write(tmp: Path) -> None:
            tmp.mkdir()
            save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
            (tmp / "adapter_config.json").write_text(json.dumps(peft_adapter_config(config, modules, str(base)),
                                                                indent=2))

        peft_dir = _atomic_dir(Path(adapter_out), write)
    return merged_dir, peft_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="DCP checkpoint directory (save_checkpoint output)")
    ap.add_argument("--base", required=True, help="HF directory the run started from (config + tokenizer)")
    ap.add_argument("--out", default=None, help="output HF directory (a LoRA checkpoint: merged into the base)")
    ap.add_argument("--adapter-out", default=None, help="a LoRA checkpoint's PEFT adapter directory")
    ap.add_argument("--head", choices=["value"], default=None, help="export a value/reward model")
    ap.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast weights (default: as saved)")
    ap.add_argument("--prefix", default="model.", help="key prefix of the model state dict inside the DCP")
    args = ap.parse_args(argv)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    if _is_lora(args.checkpoint, args.prefix):
        for written in merge_lora_checkpoint(args.checkpoint, args.base, args.out, adapter_out=args.adapter_out,
                                             dtype=dtype, prefix=args.prefix):
            if written is not None:
                print(f"wrote {written}")
        return
    if args.out is None or args.adapter_out is not None:
        ap.error("a full-model checkpoint takes --out (and no --adapter-out: it has no adapters)")
    out = merge_checkpoint(args.checkpoint, args.base, args.out, head=args.head, dtype=dtype, prefix=args.prefix)
    print(f"wrote {out}")


def _is_lora(checkpoint: str, prefix: str) -> bool:
    metadata = Path(checkpoint) / ".metadata"
    if not metadata.is_file():
        return False  # merge_checkpoint reports it
    return any(k.startswith(prefix) and is_adapter(k)
               for k in FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata)


if __name__ == "__main__":
    main()
