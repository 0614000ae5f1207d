"""Build on the meta device, parallelize, then fill the shards straight from safetensors.

No rank ever holds the whole model. With plain FSDP2 (a parameter sharded on dim 0 only) each rank
reads only its shard's rows from the file; otherwise (TP splits) it reads one full checkpoint tensor at
a time and keeps its slice, cut with `distribute_tensor(..., src_data_rank=None)` (local slicing, no
communication). Peak memory during a load is about the shards plus one tensor.

    model = build_meta_causal_lm(path)               # no memory
    parallelize(model, dp_mesh=..., tp_mesh=...)     # DTensor shards, still on meta
    load_weights(model, path, device="cuda")         # materialise + fill the shards

`load_causal_lm_sharded` does the three steps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from torchrlhf.models.lm_head import LogProbHead
from torchrlhf.models.loading import _existing, _is_gguf
from torchrlhf.models.moe import install_routers, stacked_expert_sources
from torchrlhf.models.packed_attention import ATTN_IMPLEMENTATION
from torchrlhf.models.parallelize import parallelize


def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The safetensors files of a HF directory (sharded via model.safetensors.index.json or single)."""
    d = _existing(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [d / n for n in names]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {d} (convert .bin/.gguf checkpoints first)")
    return files


class SafetensorsReader:
    """Lazy tensor-by-name access over all safetensors files of a HF dir.

    A mixture-of-experts checkpoint's per-expert tensors are also readable under the model's stacked names
    (``...experts.gate_up_proj`` [experts, 2 x inter, hidden], ``...experts.down_proj``; `models.moe`), and a
    dim-0 shard of those reads only its experts."""

    def __init__(self, model_dir: str | os.PathLike):
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for f in safetensors_files(model_dir):
            handle = self._stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for key in handle.keys():
                self._where[key] = handle
        self._stacked = stacked_expert_sources(self._where)

    def keys(self) -> set[str]:
        return set(self._where) | set(self._stacked)

    def __contains__(self, key: str) -> bool:
        return key in self._where or key in self._stacked

    def get(self, key: str) -> torch.Tensor:
        if key in self._stacked:
            return self.get_rows(key, 0, len(self._stacked[key]))
        return self._where[key].get_tensor(key)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._stacked:
            parts = [tuple(self._where[k].get_slice(k).get_shape()) for k in self._stacked[key][0]]
            return (len(self._stacked[key]), sum(p[0] for p in parts), *parts[0][1:])
        return tuple(self._where[key].get_slice(key).get_shape())

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of a tensor, reading only their bytes (a dim-0 shard; experts for stacked ones)."""
        if key in self._stacked:
            return torch.stack([torch.cat([self._where[k].get_tensor(k) for k in parts])
                                for parts in self._stacked[key][start:stop]])
        return self._where[key].get_slice(key)[start:stop]

    def close(self) -> None:
        self._stack.close()


@contextmanager
def _reader(model_dir) -> Iterator[SafetensorsReader]:
    r = SafetensorsReader(model_dir)
    try:
        yield r
    finally:
        r.close()


def build_meta_causal_lm(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The architecture of the HF dir at `path` (with a `LogProbHead`), every tensor on the meta device."""
    config = AutoConfig.from_pretrained(str(_existing(path)))
    config._attn_implementation = ATTN_IMPLEMENTATION
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    install_routers(model)
    LogProbHead.install(model)
    return model


def _reset_rotary_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute the non-persistent RoPE buffers that `to_empty` left uninitialised."""
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "config"):
            with torch.device(device):
                fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(module, name).copy_(buf)


def _row_shard(param: torch.Tensor) -> tuple[int, int] | None:
    """(start, stop) rows of this rank's shard when ``param`` is sharded on dim 0 only (plain FSDP2), else None."""
    if not isinstance(param, DTensor):
        return None
    placements = param.placements
    if any(not (p.is_replicate() or (type(p) is Shard and p.dim == 0)) for p in placements):
        return None  # TP's column splits and FSDP2 × TP strided shards: read the full tensor
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, placements)
    return offset[0], offset[0] + shape[0]


def _fill_from(reader: SafetensorsReader, name: str, param: torch.Tensor) -> None:
    """Copy this rank's part of checkpoint tensor ``name`` into ``param``, reading only its rows when it can."""
    rows = _row_shard(param)
    if rows is None:
        _fill(param, reader.get(name), name)
        return
    _check_shape(name, reader.shape(name), param)
    with torch.no_grad():
        param.to_local().copy_(reader.get_rows(name, *rows))


def _check_shape(name: str, shape: tuple[int, ...], param: torch.Tensor) -> None:
    if tuple(shape) != tuple(param.shape):
        hint = (" (a mixture-of-experts checkpoint with another expert count than its config.json's?)"
                if ".experts." in name or name.endswith("mlp.gate.weight") else "")
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(shape)}, model expects {tuple(param.shape)}{hint}")


def _fill(param: torch.Tensor, full: torch.Tensor, name: str) -> None:
    """Copy this rank's part of `full` (checkpoint tensor ``name``) into `param` (a DTensor shard or a plain
    tensor)."""
    _check_shape(name, tuple(full.shape), param)
    with torch.no_grad():
        if isinstance(param, DTensor):
            full = full.to(device=param.device, dtype=param.dtype)
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


def load_weights(
    model: nn.Module,
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    extra: dict[str, torch.Tensor] | None = None,
    strict: bool = True,
    cpu_offload: bool = False,
) -> list[str]:
    """Materialise a (meta, possibly parallelized) model on `device` and load the HF dir's weights into it.

    Parameter names must match the checkpoint keys (as for HF causal LMs and the
    `ValueModel` head). `extra` supplies full tensors the checkpoint lacks (e.g. a
    fresh value head). A tied lm_head is one parameter and is loaded once. Returns
    the names that were neither in the checkpoint nor in `extra`; with `strict`
    such names raise a KeyError. With `cpu_offload` (FSDP2 CPUOffloadPolicy) parameters
    live on the CPU and only buffers go to `device`.
    """
    device = torch.device(device)
    if any(p.is_meta for p in model.parameters()) or any(b.is_meta for b in model.buffers()):
        model.to_empty(device="cpu" if cpu_offload else device)
    if cpu_offload:
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
    _reset_rotary_buffers(model, device)
    extra = extra or {}
    missing = []
    with _reader(path) as reader:
        for name, param in model.named_parameters():  # deduplicated: a tied weight appears once
            if name in reader:
                _fill_from(reader, name, param)
            elif name in extra:
                _fill(param, extra[name], name)
            else:
                missing.append(name)
        for name, buf in model.named_buffers():
            if name in reader:
                _fill(buf, reader.get(name), name)
    if strict and missing:
        raise KeyError(f"weights missing from {path}: {missing}")
    return missing


def load_causal_lm_sharded(
    path: str | os.PathLike,
    *,
    dp_mesh: DeviceMesh,
    tp_mesh: DeviceMesh | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device | None = None,
    **parallelize_kwargs,
) -> PreTrainedModel:
    """A causal LM from a HF dir, built on meta, parallelized (FSDP2 × TP) and loaded shard by shard.

    `parallelize_kwargs` go to `parallelize` (param_dtype, cpu_offload, activation_checkpointing, ...).
    `device` defaults to the mesh's device (cuda:current on GPU, cpu otherwise).
    """
    if _is_gguf(Path(path)):
        raise ValueError(f"{path}: sharded loading reads safetensors; convert the GGUF first "
                         "(smollm2_model_dir, or load_causal_lm(...).save_pretrained(dir))")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dp_mesh.device_type == "cuda" else "cpu"
    model = build_meta_causal_lm(path, dtype=dtype)
    parallelize(model, dp_mesh=dp_mesh, tp_mesh=tp_mesh, **parallelize_kwargs)
    load_weights(model, path, device=device, cpu_offload=parallelize_kwargs.get("cpu_offload", False))
    return model
