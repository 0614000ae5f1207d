"""Weight sync for split placement: the actor's ranks push full weights to rollout ranks, bucket by bucket.

The actor group and the rollout group live on disjoint ranks. A sync group holds the actor's first rank
(the source) and every rollout rank. Per bucket of parameters (at most ``bucket_bytes``, one parameter
when a parameter alone is larger):

    actor ranks:   gather each parameter's full tensor (FSDP2 all-gather inside the actor group)
    source rank:   pack the bucket into one flat buffer in the engine's dtype, broadcast it on the sync group
    rollout ranks: receive the buffer, hand each tensor (or its TP shard) to ``engine.update_weights``

Nothing passes through the controller (it only starts both sides), and no rank holds more than one
bucket of full tensors beyond what the engine itself keeps. Both sides walk the same `manifest` (names,
shapes, in ``model.named_parameters()`` order, tied weights once), which the controller hands over once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torch.distributed.tensor import DTensor

Manifest = list[tuple[str, tuple[int, ...]]]


@dataclass
class SyncStats:
    """One weight sync on one rank: bytes broadcast, buckets, wall seconds."""

    bytes: int = 0
    buckets: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {"bytes": float(self.bytes), "buckets": float(self.buckets), "seconds": self.seconds}


def weight_manifest(model: nn.Module, select: Callable[[str], bool] | None = None) -> Manifest:
    """(HF name, full shape) of every parameter (or those ``select`` picks: a LoRA actor's adapters), in the
    order `send_weights` streams them."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters() if select is None or select(name)]


def plan_buckets(manifest: Manifest, dtype: torch.dtype, bucket_bytes: int) -> list[list[int]]:
    """Consecutive manifest indices grouped so a bucket stays under ``bucket_bytes`` (a larger tensor alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    size = torch.empty((), dtype=dtype).element_size()
    buckets: list[list[int]] = [[]]
    used = 0
    for i, (_, shape) in enumerate(manifest):
        nbytes = size * torch.Size(shape).numel()
        if buckets[-1] and used + nbytes > bucket_bytes:
            buckets.append([])
            used = 0
        buckets[-1].append(i)
        used += nbytes
    return [b for b in buckets if b]


def _full_weights(model: nn.Module, names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensor of every parameter in ``names`` on every rank of the model's group, one at a time
    (collective if sharded).

    Gathers on the training mesh's own groups: creating groups here could deadlock, since the ranks of a
    split-placement actor belong to different numbers of groups (only the first is in the sync group).
    """
    for name, p in model.named_parameters():
        if name in names:
            yield name, (p.full_tensor() if isinstance(p, DTensor) else p).detach()


def send_weights(
    model: nn.Module, group: dist.ProcessGroup | None, src: int, manifest: Manifest, dtype: torch.dtype,
    bucket_bytes: int,
) -> SyncStats:
    """Actor side, on every rank of the actor group: gather full tensors; rank ``src`` broadcasts each bucket.

    ``group`` is the sync group (None on actor ranks outside it, which only take part in the gathers).
    """
    stats, start = SyncStats(), time.perf_counter()
    stream = _full_weights(model, {name for name, _ in manifest})
    failure: Exception | None = None  # a receiver died: keep gathering so the other actor ranks finish too
    for bucket in plan_buckets(manifest, dtype, bucket_bytes):
        parts = []
        for i in bucket:
            name, tensor = next(stream)
            if name != manifest[i][0] or tuple(tensor.shape) != manifest[i][1]:
                raise RuntimeError(f"send_weights: got {name!r} {tuple(tensor.shape)} where the manifest has "
                                   f"{manifest[i][0]!r} {manifest[i][1]}; the model changed since the manifest")
            if dist.get_rank() == src:
                parts.append(tensor.detach().reshape(-1).to(dtype))
        if dist.get_rank() == src and failure is None:
            flat = torch.cat(parts)
            try:
                dist.broadcast(flat.view(torch.uint8), src=src, group=group)
            except RuntimeError as e:
                failure = e
                continue
            stats.bytes += flat.numel() * flat.element_size()
            stats.buckets += 1
    if next(stream, None) is not None:
        raise RuntimeError("send_weights: the model has more parameters than the manifest")
    if failure is not None:
        raise RuntimeError(f"send_weights: the broadcast to the rollout ranks failed: {failure}") from failure
    stats.seconds = time.perf_counter() - start
    return stats


def local_shard(engine, name: str, full: torch.Tensor, dims: dict[str, int | None]) -> torch.Tensor:
    """This rank's part of a full tensor in ``engine``'s TP layout (``dims``: its `param_shard_dims`)."""
    dim = dims.get(name)
    tp = engine.tp_size
    if dim is None or tp == 1:
        return full
    return torch.chunk(full, tp, dim=dim)[engine.tp_mesh.get_local_rank()]


def receive_weights(
    engine, group: dist.ProcessGroup, src: int, manifest: Manifest, dtype: torch.dtype, bucket_bytes: int,
    device: torch.device | None = None,
) -> SyncStats:
    """Rollout side, on every rollout rank: receive each bucket and load it into ``engine``."""
    stats, start = SyncStats(), time.perf_counter()
    dims = engine.param_shard_dims()
    size = torch.empty((), dtype=dtype).element_size()

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in plan_buckets(manifest, dtype, bucket_bytes):
            numels = [torch.Size(manifest[i][1]).numel() for i in bucket]
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
            dist.broadcast(flat.view(torch.uint8), src=src, group=group)
            stats.bytes += flat.numel() * size
            stats.buckets += 1
            for i, part in zip(bucket, torch.split(flat, numels)):
                name, shape = manifest[i]
                yield name, local_shard(engine, name, part.view(shape), dims)

    engine.update_weights(tensors())
    stats.seconds = time.perf_counter() - start
    return stats


def sync_group_ranks(actor_ranks: Sequence[int], rollout_ranks: Sequence[int]) -> list[int]:
    """The sync group: the actor's first rank (the source) and every rollout rank."""
    return [actor_ranks[0], *rollout_ranks]
