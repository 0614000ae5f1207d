"""Distributed checkpoints of a trainable worker: DCP model + optimizer, LR scheduler, per-rank RNG.

Layout of a checkpoint directory::

    <path>/            DCP shards + .metadata (model and optimizer, resharded on load)
    <path>/state.pt    scheduler state and caller extras (written by group rank 0)
    <path>/rng_rank<k>.pt   RNG state of group rank k, all as tensors
    <path>/COMPLETE    marker, written last

Everything is written into ``<path>.tmp`` and renamed into place once complete,
so a reader never sees a half-written checkpoint under ``<path>``. DCP stores
sharded tensors with their global shapes, so a checkpoint saved on N ranks loads
on M ranks. Small files are loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

COMPLETE = "COMPLETE"
STATE_FILE = "state.pt"


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group=group)


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch / CUDA / numpy / python RNG state, as tensors (loadable with weights_only=True)."""
    version, mt, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python_version": torch.tensor(version),
        "python_mt": torch.tensor(mt, dtype=torch.int64),
        "python_gauss": torch.tensor([] if gauss is None else [gauss], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np_keys.astype(np.int64)),
        "numpy_pos": torch.tensor(np_pos),
        "numpy_gauss": torch.tensor([np_has_gauss, np_gauss], dtype=torch.float64),
    }
    assert np_kind == "MT19937"
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            state[f"cuda_{i}"] = s
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    gauss = state["python_gauss"].tolist()
    random.setstate((int(state["python_version"]), tuple(state["python_mt"].tolist()), gauss[0] if gauss else None))
    has_gauss, cached = state["numpy_gauss"].tolist()
    np.random.set_state(
        ("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(state["numpy_pos"]), int(has_gauss), cached)
    )
    if torch.cuda.is_available():
        cuda = [state[k] for k in sorted(k for k in state if k.startswith("cuda_"))]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


def is_complete(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE))


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    extra: dict[str, Any] | None = None,
    process_group: dist.ProcessGroup | None = None,
    trainable_only: bool = False,
) -> None:
    """Collective over ``process_group``: every rank of the worker group calls it with the same ``path``.

    ``extra`` holds small plain values (ints, floats, strings, lists/dicts of them)
    that must load with ``weights_only=True``. An existing complete checkpoint at
    ``path`` is replaced only after the new one is complete. ``trainable_only`` leaves the frozen
    parameters out (a LoRA model's base: it is the model the run starts from).
    """
    path = os.fspath(path)
    tmp = f"{path}.tmp"
    rank = _group_rank(process_group)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted save
        os.makedirs(tmp)
    _barrier(process_group)

    model_sd, optim_sd = training_state_dicts(model, optimizer, trainable_only)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    dcp.save(state, checkpoint_id=tmp, process_group=process_group)
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if rank == 0:
        small = {
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra": extra or {},
            "world_size": dist.get_world_size(process_group) if process_group is not None else 1,
        }
        torch.save(small, os.path.join(tmp, STATE_FILE))
    _barrier(process_group)

    if rank == 0:
        with open(os.path.join(tmp, COMPLETE), "w") as f:
            f.write("ok\n")
        old = f"{path}.old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(process_group)


def training_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts; ``trainable_only`` keeps the parameters that require grad (a tied
    frozen alias such as ``lm_head.weight`` included: it goes too)."""
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [],
                                        options=StateDictOptions(ignore_frozen_params=trainable_only))
    if trainable_only:
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k not in frozen}
    return model_sd, optim_sd


def _check_model_keys(path: str, model_sd: dict[str, Any], trainable_only: bool) -> None:
    """A clear error when the checkpoint lacks weights the model asks for (e.g. a full-model checkpoint
    loaded by a LoRA model, or the reverse), before DCP reports them as unreadable."""
    try:
        saved = set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception:  # noqa: BLE001 - an unreadable checkpoint is reported by the load itself
        return
    missing = [k for k in model_sd if f"model.{k}" not in saved]
    if missing:
        what = "adapter (LoRA) weights only" if trainable_only else "every model weight"
        raise ValueError(f"checkpoint {path} lacks model weights {missing[:3]}{'...' if len(missing) > 3 else ''}; "
                         f"this worker loads {what}: was it saved by a model with another LoRA setting?")


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    process_group: dist.ProcessGroup | None = None,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Collective: restore what `save_checkpoint` wrote (any world size); returns the saved ``extra``.
    ``trainable_only`` as when saving (the frozen parameters keep the values they have).

    RNG state is restored for group ranks that existed when saving; ranks beyond the
    saved world size keep their current (seed-derived) RNG.
    """
    path = os.fspath(path)
    if not is_complete(path):
        raise FileNotFoundError(f"no complete checkpoint at {path!r} (missing {COMPLETE} marker)")
    model_sd, optim_sd = training_state_dicts(model, optimizer, trainable_only)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optimizer"] = optim_sd
    _check_model_keys(path, model_sd, trainable_only)
    try:
        dcp.load(state, checkpoint_id=path, process_group=process_group)
    except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
        raise RuntimeError(f"checkpoint {path} could not be read ({type(e).__name__}: {e}); a file in it may be "
                           "corrupted or truncated: resume from an earlier checkpoint") from e
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optimizer", {}),
        options=StateDictOptions(strict=not trainable_only),  # a partial state: `_check_model_keys` checked it
    )
    small = torch.load(os.path.join(path, STATE_FILE), weights_only=True)
    if scheduler is not None:
        if small["scheduler"] is None:
            raise ValueError(f"checkpoint {path!r} has no LR scheduler state")
        scheduler.load_state_dict(small["scheduler"])
    rng_file = os.path.join(path, f"rng_rank{_group_rank(process_group)}.pt")
    if os.path.isfile(rng_file):
        set_rng_state(torch.load(rng_file, weights_only=True))
    _barrier(process_group)
    return small["extra"]
