"""In-memory snapshots of a trainable worker's state, in node-local shared memory, every step.

A snapshot holds what a disk checkpoint holds (`utils.checkpoint`): this rank's model and optimizer shards,
the LR scheduler and the RNG. It is written as raw bytes into a file under a tmpfs (``/dev/shm``), so writing
it is one copy per tensor, not a serialization, and it outlives the processes: a job restarted by torchrun
reads it back. Two slots alternate, so a kill in the middle of a write leaves the other slot, the last
published snapshot, intact; the controller publishes a slot (`trainer.checkpointing.SnapshotManager`) only
once every rank has written it.

Unlike a DCP checkpoint a snapshot is not resharded: it loads only into the same layout (the same group
size, tensor names, shapes and dtypes, all checked).

Layout, per slot ``<root>/slot<i>/<role>/``::

    rank<k>.bin   the tensors' bytes (k: the global rank), space reserved at start-up by `reserve`
    rank<k>.pt    what they are (names, dtypes, shapes, offsets), the scheduler, the RNG, the step;
                  written after the bytes, so a ``.pt`` names a step only once its bytes are whole
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
from torch.distributed.tensor import DTensor

from torchrlhf.utils.checkpoint import rng_state, set_rng_state, training_state_dicts

SLOTS = 2
_ALIGN = 64
_TENSOR = "__snapshot_tensor__"


def rank_files(root: str, slot: int, role: str, rank: int) -> tuple[str, str]:
    """(bytes, description) files of one rank's state in one slot."""
    base = os.path.join(root, f"slot{slot}", role, f"rank{rank}")
    return base + ".bin", base + ".pt"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _flatten(tree: Any, path: str, out: dict[str, torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by a marker naming its path; the tensors go to ``out``."""
    if isinstance(tree, torch.Tensor):
        out[path] = tree
        return {_TENSOR: path}
    if isinstance(tree, dict):
        return {k: _flatten(v, f"{path}/{k}", out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_flatten(v, f"{path}/{i}", out) for i, v in enumerate(tree))
    return tree


def _unflatten(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if set(tree) == {_TENSOR}:
            return tensors[tree[_TENSOR]]
        return {k: _unflatten(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_unflatten(v, tensors) for v in tree)
    return tree


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, trainable_only: bool
           ) -> tuple[Any, dict[str, torch.Tensor]]:
    """The model and optimizer state as a tensor-free skeleton and {path: tensor} (DTensors as they are)."""
    model_sd, optim_sd = training_state_dicts(model, optimizer, trainable_only)  # what a checkpoint holds
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten({"model": model_sd, "optimizer": optim_sd if optimizer is not None else {}}, "", tensors)
    return skeleton, tensors


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[list[tuple[str, str, list[int], int, int]], int]:
    """[(path, dtype, local shape, offset, bytes)] with each tensor's bytes at a 64-byte-aligned offset."""
    entries, offset = [], 0
    for path, t in tensors.items():
        local = _local(t)
        nbytes = local.numel() * local.element_size()
        entries.append((path, str(local.dtype).removeprefix("torch."), list(local.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return entries, offset


def estimate_bytes(model: torch.nn.Module, trainable_only: bool, optimizer_states: int = 2) -> int:
    """One slot's bytes before the optimizer has state: this rank's weights plus ``optimizer_states`` tensors
    the size of each trainable one (Adam's two moments), each aligned as `_layout` aligns them."""
    total = 0
    for p in model.parameters():
        if trainable_only and not p.requires_grad:
            continue
        local = _local(p)
        one = -(-local.numel() * local.element_size() // _ALIGN) * _ALIGN
        total += one * (1 + optimizer_states) + _ALIGN if p.requires_grad else one  # + Adam's step counter
    return total


def reserve(root: str, role: str, rank: int, nbytes: int) -> None:
    """Claim ``nbytes`` of the filesystem under ``root`` for each slot's bytes file of this rank now, so that
    shared memory too small for the snapshot fails at start-up with a clear error instead of mid-run (a
    write into an unreserved tmpfs page can raise SIGBUS). Reserving keeps what a file already holds."""
    try:
        for slot in range(SLOTS):
            _claim(rank_files(root, slot, role, rank)[0], nbytes, root, role, rank)
    except RuntimeError:
        for slot in range(SLOTS):  # give back what this rank claimed
            for f in rank_files(root, slot, role, rank):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(f)
        raise


def _claim(bin_file: str, nbytes: int, root: str, role: str, rank: int) -> None:
    """Make ``bin_file`` hold at least ``nbytes`` of allocated space; the one clear error when it cannot."""
    os.makedirs(os.path.dirname(bin_file), exist_ok=True)
    try:
        fd = os.open(bin_file, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)
    except OSError as e:
        free = shutil.disk_usage(os.path.dirname(bin_file)).free
        raise RuntimeError(
            f"trainer.checkpoint.snapshot_freq: the memory snapshot of {role} rank {rank} needs {SLOTS} x "
            f"{nbytes / 2**30:.2f} GiB under {root} ({e.strerror}; {free / 2**30:.2f} GiB free there, shared "
            "by every rank of this node): give the machine more shared memory (docker --shm-size), set "
            "trainer.checkpoint.snapshot_dir to a larger tmpfs, or turn snapshots off with "
            "trainer.checkpoint.snapshot_freq=0") from e


class SnapshotWriter:
    """One rank's snapshot writes, each on a background thread, so training goes on while the bytes go to
    shared memory: the rollout and the log-prob passes read the weights and the optimizer state, they do not
    change them. Whatever changes them (an optimizer step, a checkpoint load, moving the optimizer state off
    the accelerator) calls `wait` first, so a write never sees a half-updated state.

    What is not tensors (the scheduler, the RNG, the layout) is taken when the write starts, on the caller's
    thread. The description file (``rank<k>.pt``) is written after the bytes, so until the thread is done the
    slot names no step and the controller cannot publish it. The thread copies through file writes, not torch
    ops, so it never starts an OpenMP team of its own (`runtime.compute_thread`).
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._written: int = 0
        self._error: BaseException | None = None

    def start(self, root: str, slot: int, step: int, *, role: str, rank: int, model: torch.nn.Module,
              optimizer: torch.optim.Optimizer | None = None,
              scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
              process_group: dist.ProcessGroup | None = None, trainable_only: bool = False) -> int:
        """Start writing this rank's state into ``slot`` (after any write still running); returns its bytes."""
        self.wait()
        skeleton, tensors = _state(model, optimizer, trainable_only)
        entries, total = _layout(tensors)
        bin_file, meta_file = rank_files(root, slot, role, rank)
        with contextlib.suppress(FileNotFoundError):
            os.remove(meta_file)  # this slot no longer describes a whole state until the new bytes are in
        _claim(bin_file, total, root, role, rank)  # more than reserved (an optimizer with more state than Adam's)
        meta = {"step": step, "role": role, "rank": rank, "total": total, "entries": entries, "skeleton": skeleton,
                "group_size": dist.get_world_size(process_group) if process_group is not None else 1,
                "scheduler": copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None,
                "rng": rng_state()}
        locals_ = [(offset, _local(t)) for (_, _, _, offset, _), t in zip(entries, tensors.values())]
        self._thread = threading.Thread(target=self._write, args=(bin_file, meta_file, locals_, meta, total),
                                        name=f"torchrlhf-snapshot-{role}{rank}", daemon=True)
        self._thread.start()
        return total

    def _write(self, bin_file: str, meta_file: str, tensors: list[tuple[int, torch.Tensor]], meta: dict,
               total: int) -> None:
        try:
            with open(bin_file, "r+b") as f:
                for offset, t in tensors:
                    f.seek(offset)
                    f.write(_bytes(t))
            tmp = meta_file + ".tmp"
            torch.save(meta, tmp)
            os.replace(tmp, meta_file)
            self._written = total
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by `wait`
            self._error = e

    def wait(self) -> int:
        """Block until the last write is whole; returns its bytes (0 when there was none) or raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"writing the memory snapshot failed: {type(error).__name__}: {error}") from error
        written, self._written = self._written, 0
        return written


def snapshot_step(root: str, slot: int, role: str, rank: int) -> int | None:
    """The step this rank's state in ``slot`` is from; None when the slot holds no whole state of it."""
    _, meta_file = rank_files(root, slot, role, rank)
    try:
        return int(torch.load(meta_file, weights_only=True)["step"])
    except Exception:  # noqa: BLE001 - missing, half-written or foreign: not loadable
        return None


def load_snapshot(root: str, slot: int, step: int, *, role: str, rank: int, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None = None,
                  scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                  process_group: dist.ProcessGroup | None = None, trainable_only: bool = False) -> None:
    """Restore what `SnapshotWriter` wrote at ``step`` into the same layout, reading each tensor's bytes
    straight into its storage."""
    bin_file, meta_file = rank_files(root, slot, role, rank)
    meta = torch.load(meta_file, weights_only=True)
    where = f"memory snapshot {meta_file}"
    if meta["step"] != step:
        raise RuntimeError(f"{where} holds step {meta['step']}, not the published step {step}")
    group_size = dist.get_world_size(process_group) if process_group is not None else 1
    if meta["group_size"] != group_size:
        raise RuntimeError(f"{where} was written by {meta['group_size']} ranks of {role}, this run has {group_size}")
    _, tensors = _state(model, optimizer, trainable_only)
    want, _ = _layout(tensors)
    saved = {e[0]: e for e in meta["entries"]}
    for path, dtype, shape, _, nbytes in want:
        if path not in saved or saved[path][1:3] != (dtype, shape) or saved[path][4] != nbytes:
            got = saved.get(path)
            raise RuntimeError(f"{where} does not match this run's {role}: {path} is "
                               f"{(got[1], got[2]) if got else 'missing'} there, {(dtype, shape)} here")
    if len(saved) != len(want):
        extra = sorted(set(saved) - {e[0] for e in want})[:3]
        raise RuntimeError(f"{where} holds state this run's {role} lacks: {extra}")
    with open(bin_file, "rb") as f:
        for path, t in tensors.items():
            f.seek(saved[path][3])
            _read_into(f, _local(t), saved[path][4], where)
    model_sd = _unflatten(meta["skeleton"], tensors)
    set_state_dict(model, optimizer if optimizer is not None else [], model_state_dict=model_sd["model"],
                   optim_state_dict=model_sd["optimizer"], options=StateDictOptions(strict=not trainable_only))
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    set_rng_state(meta["rng"])


def drop_snapshot(root: str, role: str, rank: int) -> None:
    """Delete this rank's files in every slot (a finished run gives its shared memory back)."""
    for slot in range(SLOTS):
        for f in rank_files(root, slot, role, rank):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f)


def _bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return memoryview(flat.contiguous().view(torch.uint8).numpy())


def _read_into(f, dst: torch.Tensor, nbytes: int, where: str) -> None:
    direct = dst.device.type == "cpu" and dst.is_contiguous()
    buf = dst.detach().reshape(-1).view(torch.uint8) if direct else torch.empty(nbytes, dtype=torch.uint8)
    if f.readinto(memoryview(buf.numpy())) != nbytes:
        raise RuntimeError(f"{where} is truncated")
    if not direct:
        with torch.no_grad():
            dst.copy_(buf.view(dst.dtype).view(dst.shape))
