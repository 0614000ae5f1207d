"""In-memory snapshots of a trainable worker's state, in node-local shared memory, every step.

A snapshot holds what a disk checkpoint holds (`utils.checkpoint`): this rank's model and optimizer shards,
the LR scheduler and the RNG. It is written as raw bytes into a file under a tmpfs (``/dev/shm``), so writing
it is one copy per tensor, not a serialization, and it outlives the processes: a job restarted by torchrun
reads it back. Two slots alternate, so a kill in the middle of a write leaves the other slot, the last
published snapshot, intact; the controller publishes a slot (`trainer.checkpointing.SnapshotManager`) only
once every rank has written it.

Unlike a DCP checkpoint a snapshot is not resharded: it loads only into the same layout (the same group
size, tensor names, shapes and dtypes, all checked).

With a peer copy (`PeerLink`), each rank also sends its slot to a rank on another node, which keeps it in
that node's memory: losing one node loses no part of the snapshot. A restart whose rank finds its own part
missing gets it back from the copy (`fetch_copies`).

Layout, per slot ``<root>/node<n>/slot<i>/<role>/`` (n: the node, `node_root`)::

    rank<k>.bin        the tensors' bytes (k: the global rank), space reserved at start-up by `reserve`
    rank<k>.pt         what they are (names, dtypes, shapes, offsets), the scheduler, the RNG, the step;
                       written after the bytes, so a ``.pt`` names a step only once its bytes are whole
    peer/rank<j>.bin   rank j's part, copied here from another node (the same two files)
    peer/rank<j>.pt
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
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


def node_root(root: str) -> str:
    """This node's part of the snapshot directory, ``<root>/node<n>`` (n: torchrun's ``GROUP_RANK``). On separate
    machines the tmpfs is node-local anyway; on one machine running several torchrun agents, the parts keep the
    agents' "nodes" apart, as separate memories would be."""
    return os.path.join(root, f"node{os.environ.get('GROUP_RANK', '0')}")


def rank_files(root: str, slot: int, role: str, rank: int, *, copy_of: bool = False) -> tuple[str, str]:
    """(bytes, description) files of one rank's state in one slot of a node's ``root``; ``copy_of``: the copy
    another node's rank keeps here."""
    base = os.path.join(root, f"slot{slot}", role, *(["peer"] if copy_of else []), f"rank{rank}")
    return base + ".bin", base + ".pt"


@dataclasses.dataclass(frozen=True)
class PeerLink:
    """Where this rank's snapshot copy goes: ``to`` (a global rank on another node) keeps it, and this rank keeps
    the copy of ``from_``. ``group``: a process group of the role's ranks used for nothing else, so the copies
    travel on the writer's thread while training uses its own groups."""

    group: dist.ProcessGroup
    to: int
    from_: int

    def swap_sizes(self, nbytes: int) -> int:
        """Tell ``to`` this rank's slot size; returns the size of the copy this rank keeps (``from_``'s)."""
        theirs = torch.empty(1, dtype=torch.int64)
        _wait_all(dist.isend(torch.tensor([nbytes]), self.to, group=self.group),
                  dist.irecv(theirs, self.from_, group=self.group))
        return int(theirs)

    @staticmethod
    def connect(group: dist.ProcessGroup, role: str) -> PeerLink:
        """Pair every rank of ``group`` with a rank on another node (collective): the ranks in order, each sending
        to the one ``shift`` places on, the smallest shift that crosses a node for every rank."""
        ranks = dist.get_process_group_ranks(group)
        nodes: list[Any] = [None] * len(ranks)
        dist.all_gather_object(nodes, os.environ.get("GROUP_RANK", "0"), group=group)
        me, n = ranks.index(dist.get_rank()), len(ranks)
        for shift in range(1, n):
            if all(nodes[i] != nodes[(i + shift) % n] for i in range(n)):
                return PeerLink(group, ranks[(me + shift) % n], ranks[(me - shift) % n])
        raise ValueError(f"trainer.checkpoint.snapshot_peer: the {role}'s ranks {ranks} are on nodes {nodes}; a copy "
                         "on a peer node needs every rank's part to go to another node (ranks on two nodes or more, "
                         "the same number on each)")


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


def reserve(root: str, role: str, rank: int, nbytes: int, *, copy_of: bool = False) -> None:
    """Claim ``nbytes`` of the filesystem under ``root`` for each slot's bytes file of this rank (``copy_of``: of
    the copy kept here of another node's ``rank``) now, so that shared memory too small for the snapshot fails
    at start-up with a clear error instead of mid-run (a write into an unreserved tmpfs page can raise SIGBUS).
    Reserving keeps what a file already holds."""
    try:
        for slot in range(SLOTS):
            _claim(rank_files(root, slot, role, rank, copy_of=copy_of)[0], nbytes, root, role, rank)
    except RuntimeError:
        for slot in range(SLOTS):  # give back what this rank claimed
            for f in rank_files(root, slot, role, rank, copy_of=copy_of):
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
              process_group: dist.ProcessGroup | None = None, trainable_only: bool = False,
              peer: PeerLink | None = None) -> int:
        """Start writing this rank's state into ``slot`` (after any write still running), and with ``peer`` its
        copy to the peer's node; returns its bytes."""
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
        copy_to = None if peer is None else (peer, rank_files(root, slot, role, peer.from_, copy_of=True), root)
        self._thread = threading.Thread(target=self._write,
                                        args=(bin_file, meta_file, locals_, meta, total, copy_to),
                                        name=f"torchrlhf-snapshot-{role}{rank}", daemon=True)
        self._thread.start()
        return total

    def _write(self, bin_file: str, meta_file: str, tensors: list[tuple[int, torch.Tensor]], meta: dict,
               total: int, copy_to: tuple[PeerLink, tuple[str, str], str] | None) -> None:
        try:
            with open(bin_file, "r+b") as f:
                for offset, t in tensors:
                    f.seek(offset)
                    f.write(_bytes(t))
            desc = _encoded(meta)
            _write_atomic(meta_file, desc)
            if copy_to is not None:  # send ours to the peer, keep the copy of the rank that sends to us
                peer, kept, root = copy_to
                sent = (torch.from_file(bin_file, shared=False, size=total, dtype=torch.uint8),
                        torch.frombuffer(bytearray(desc), dtype=torch.uint8))
                _exchange(peer.group, peer.to, sent, (peer.from_, *kept), root, meta["role"])
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
    """Delete this rank's files in every slot, and the copies it keeps (a finished run gives its memory back)."""
    for slot in range(SLOTS):
        for f in rank_files(root, slot, role, rank):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f)
        shutil.rmtree(os.path.dirname(rank_files(root, slot, role, rank, copy_of=True)[0]), ignore_errors=True)


def snapshot_holdings(root: str, slot: int, role: str, rank: int) -> dict[str, Any]:
    """What this node keeps of ``slot`` for this rank: ``own`` (the step of its own part, or None) and ``copies``
    ({global rank: step} of the other nodes' parts it keeps)."""
    copies = {}
    folder = os.path.dirname(rank_files(root, slot, role, 0, copy_of=True)[0])
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if name.startswith("rank") and name.endswith(".pt"):
                other = int(name[4:-3])
                step = _described_step(rank_files(root, slot, role, other, copy_of=True)[1])
                if step is not None:
                    copies[other] = step
    return {"own": _described_step(rank_files(root, slot, role, rank)[1]), "copies": copies}


def fetch_copies(root: str, slot: int, role: str, rank: int, sources: dict[int, int], group: dist.ProcessGroup
                 ) -> None:
    """Give back the parts some ranks lost (collective over the role's ``group``): ``sources`` maps each such
    rank to the rank that keeps its copy, which sends it; the rank writes it as its own part again. Pairs go in
    one order on every rank, so no two wait on each other."""
    for lost, keeper in sorted(sources.items()):
        if rank == keeper:
            _send_files(group, lost, *rank_files(root, slot, role, lost, copy_of=True))
        elif rank == lost:
            _recv_files(group, keeper, *rank_files(root, slot, role, lost), root, role)


def _described_step(meta_file: str) -> int | None:
    try:
        return int(torch.load(meta_file, weights_only=True)["step"])
    except Exception:  # noqa: BLE001 - missing, half-written or foreign: not loadable
        return None


def _encoded(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _write_atomic(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _exchange(group: dist.ProcessGroup, to: int, sent: tuple[torch.Tensor, torch.Tensor], recv: tuple[int, str, str],
              root: str, role: str) -> None:
    """Send this rank's (bytes, description) to ``to`` and receive another rank's files at once (every rank of a
    ring does both)."""
    from_, kept_bin, kept_meta = recv
    sizes = torch.tensor([sent[0].numel(), sent[1].numel()], dtype=torch.int64)
    theirs = torch.empty(2, dtype=torch.int64)
    _wait_all(dist.isend(sizes, to, group=group), dist.irecv(theirs, from_, group=group))
    with contextlib.suppress(FileNotFoundError):
        os.remove(kept_meta)  # the copy describes no step until its new bytes are in
    _claim(kept_bin, int(theirs[0]), root, role, from_)
    kept = torch.from_file(kept_bin, shared=True, size=int(theirs[0]), dtype=torch.uint8)
    kept_desc = torch.empty(int(theirs[1]), dtype=torch.uint8)
    _wait_all(dist.isend(sent[0], to, group=group), dist.irecv(kept, from_, group=group),
              dist.isend(sent[1], to, group=group), dist.irecv(kept_desc, from_, group=group))
    _write_atomic(kept_meta, kept_desc.numpy().tobytes())


def _send_files(group: dist.ProcessGroup, to: int, bin_file: str, meta_file: str) -> None:
    data, desc = _file_tensors(bin_file, meta_file)
    dist.send(torch.tensor([data.numel(), desc.numel()], dtype=torch.int64), to, group=group)
    dist.send(data, to, group=group)
    dist.send(desc, to, group=group)


def _recv_files(group: dist.ProcessGroup, from_: int, bin_file: str, meta_file: str, root: str, role: str) -> None:
    sizes = torch.empty(2, dtype=torch.int64)
    dist.recv(sizes, from_, group=group)
    _claim(bin_file, int(sizes[0]), root, role, dist.get_rank())
    data = torch.from_file(bin_file, shared=True, size=int(sizes[0]), dtype=torch.uint8)
    desc = torch.empty(int(sizes[1]), dtype=torch.uint8)
    dist.recv(data, from_, group=group)
    dist.recv(desc, from_, group=group)
    _write_atomic(meta_file, desc.numpy().tobytes())


def _file_tensors(bin_file: str, meta_file: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's bytes, mapped from its file (no copy), and its description."""
    with open(meta_file, "rb") as f:
        desc = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
    total = int(torch.load(io.BytesIO(desc.numpy().tobytes()), weights_only=True)["total"])
    return torch.from_file(bin_file, shared=False, size=total, dtype=torch.uint8), desc


def _wait_all(*works: Any) -> None:
    for work in works:
        work.wait()


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
