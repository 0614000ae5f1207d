"""Stream a training-sharded model's weights into the generation layout, one parameter at a time.

`iter_generation_weights` yields ``(hf_name, local_tensor)`` where `local_tensor` is this rank's
shard in the generation layout: ``torch.chunk(full, t, tp_dim)[tp_rank]`` (the full tensor when
t == 1 or the parameter is replicated). Every rank of the mesh must iterate it to the end together
(each step runs collectives). The consumer must copy a yielded tensor before asking for the next:
it is freed (and counted as freed) when the generator resumes.

Routes, for FSDP2 parameters (DTensor, ``Shard(0)`` over a 1-D mesh of N ranks, chunk ``c = ceil(rows/N)``,
possibly uneven) and the ("dp", "tp") mesh of `layout.generation_mesh`:

- column-parallel (tp_dim 0) with aligned chunks: all-gather inside the micro-DP group only
  (the HybridFlow grouping makes those d shards exactly this rank's TP shard).
- row-parallel (tp_dim >= 1): all-to-all inside the TP group (each rank sends every TP peer the
  columns it needs from its own rows), then all-gather inside the micro-DP group. Each rank receives
  exactly what it lacks: the lower bound.
- replicated (tp_dim None, or t == 1): all-gather over all N ranks.
- column-parallel with unaligned uneven chunks: all-gather over all N ranks, then slice.
- anything else (other placements or meshes): ``full_tensor()`` then chunk. Exact, not minimal.

For FSDP2 × TP training parameters (2-D DTensors) on the generation mesh itself (same TP size), the
FSDP dim is redistributed to Replicate and the TP shard is reused: no TP traffic, and no bytes at
all when dp == 1; the norms, FSDP-sharded over the dp group only, are gathered inside it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

TpDimFn = Callable[[str], "int | None"]
# torch 2.13 renames all_gather_into_tensor (and warns on the old name); GPU images may have an older torch.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class ReshardStats:
    """What one train→generation transition cost on this rank.

    `peak_transient_bytes` is the high-water mark of buffers the resharder allocated and had not yet
    released (gathered tensors, padding and exchange buffers), not counting the training shards or the
    engine's own weights; backend-internal scratch of the collectives is not included.
    `bytes_received` counts bytes that arrived from other ranks (chunk padding included);
    `lower_bound_bytes` is the size of this rank's generation shards minus what it already held.
    """

    num_tensors: int = 0
    bytes_received: int = 0
    lower_bound_bytes: int = 0
    peak_transient_bytes: int = 0
    largest_tensor_bytes: int = 0  # largest generation-layout tensor yielded
    seconds: float = 0.0  # wall time of the whole stream, the consumer's copies included
    _live: int = 0

    def alloc(self, nbytes: int) -> None:
        self._live += nbytes
        self.peak_transient_bytes = max(self.peak_transient_bytes, self._live)

    def free(self, nbytes: int) -> None:
        self._live -= nbytes

    def as_dict(self) -> dict[str, float]:
        return {
            "num_tensors": self.num_tensors,
            "bytes_received": self.bytes_received,
            "lower_bound_bytes": self.lower_bound_bytes,
            "peak_transient_bytes": self.peak_transient_bytes,
            "largest_tensor_bytes": self.largest_tensor_bytes,
            "seconds": self.seconds,
        }


def _chunk_bounds(size: int, n: int, i: int) -> tuple[int, int]:
    """[start, length) of chunk i of torch.chunk(range(size), n) (the DTensor / FSDP2 convention)."""
    c = -(-size // n)
    start = min(i * c, size)
    return start, min(c, size - start)


def permute_blocks(blocks: torch.Tensor, dest: list[int], stats: ReshardStats) -> None:
    """Move row ``b`` of `blocks` to row ``dest[b]`` (a permutation), in place, with one row of scratch."""
    src = [0] * len(dest)
    for b, f in enumerate(dest):
        src[f] = b
    done = [False] * len(dest)
    for start in range(len(dest)):
        if done[start] or src[start] == start:
            continue
        scratch = blocks[start].clone()
        stats.alloc(scratch.nbytes)
        cur = start
        while src[cur] != start:
            blocks[cur].copy_(blocks[src[cur]])
            done[cur] = True
            cur = src[cur]
        blocks[cur].copy_(scratch)
        done[cur] = True
        stats.free(scratch.nbytes)
        del scratch


class _Resharder:
    """Per-transition state: the generation mesh's groups and this rank's coordinates."""

    def __init__(self, gen_mesh: DeviceMesh, tp_dim_of: TpDimFn, dtype: torch.dtype | None, stats: ReshardStats):
        if gen_mesh.ndim != 2 or gen_mesh.mesh_dim_names != ("dp", "tp"):
            raise ValueError(f"generation mesh must be 2-D with dims ('dp', 'tp'), got {gen_mesh}")
        self.mesh = gen_mesh
        self.tp_dim_of = tp_dim_of
        self.dtype = dtype
        self.stats = stats
        self.t = gen_mesh.size(1)
        # Where the collectives run: FSDP2 CPU offload keeps shards on the host, NCCL needs them on the GPU.
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if gen_mesh.device_type == "cuda" else torch.device("cpu")
        )
        self.dp_index = gen_mesh.get_local_rank("dp")
        self.tp_index = gen_mesh.get_local_rank("tp")
        self.dp_group = gen_mesh.get_group("dp")
        self.tp_group = gen_mesh.get_group("tp")
        self.grid = gen_mesh.mesh.tolist()  # grid[i][j]: global rank with dp index i, tp index j
        self.dp_ranks = [row[self.tp_index] for row in self.grid]
        # Collectives place data by group rank; the routes below assume it is the mesh coordinate.
        self.groups_in_mesh_order = (
            dist.get_process_group_ranks(self.dp_group) == self.dp_ranks
            and dist.get_process_group_ranks(self.tp_group) == self.grid[self.dp_index]
        )

    # -- helpers ---------------------------------------------------------------------------------
    def _gather_rows(self, local: torch.Tensor, c: int, group: dist.ProcessGroup, g: int, me: int) -> torch.Tensor:
        """In-place all-gather of `g` row chunks of `c` rows: my (cast, zero-padded) chunk goes to slot `me`.

        The only buffer is the output, so no padded or cast copy of the input is alive on top of it.
        """
        dtype = self.dtype or local.dtype
        out = local.new_empty((g * c, *local.shape[1:]), dtype=dtype, device=self.device)
        self.stats.alloc(out.nbytes)
        slot = out[me * c : (me + 1) * c]
        slot[: local.shape[0]].copy_(local)
        slot[local.shape[0] :].zero_()
        if g > 1:
            _all_gather_single(out, slot, group=group)
        self.stats.bytes_received += (g - 1) * slot.nbytes
        return out

    # -- routes ----------------------------------------------------------------------------------
    def convert(self, name: str, p: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(generation-layout local tensor, bytes of its transient storage to free after use)."""
        tp_dim = self.tp_dim_of(name) if self.t > 1 else None
        if tp_dim is not None and not 0 <= tp_dim < p.dim():
            raise ValueError(f"TP dim {tp_dim} of parameter {name!r} is out of range for its shape {tuple(p.shape)}")
        if not isinstance(p, DTensor):
            local = p.detach()
            if self.dtype is not None and local.dtype != self.dtype:
                local = local.to(self.dtype)
                self.stats.alloc(local.nbytes)
                return self._tp_slice(local, tp_dim), local.nbytes
            return self._tp_slice(local, tp_dim), 0
        fsdp_1d = p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and self.groups_in_mesh_order
        fsdp_1d = fsdp_1d and dist.get_process_group_ranks(p.device_mesh.get_group()) == p.device_mesh.mesh.tolist()
        if fsdp_1d and self._spans_grid(p.device_mesh):
            return self._from_fsdp(name, p, tp_dim)
        if fsdp_1d and tp_dim is None and p.device_mesh.mesh.tolist() == self.dp_ranks:
            return self._from_dp_only(p)
        if p.device_mesh == self.mesh and self._tp_placement_matches(p, tp_dim):
            return self._from_training_tp(p)
        return self._from_full(p, tp_dim)

    def _spans_grid(self, mesh: DeviceMesh) -> bool:
        return sorted(mesh.mesh.tolist()) == sorted(r for row in self.grid for r in row)

    def _tp_slice(self, full: torch.Tensor, tp_dim: int | None) -> torch.Tensor:
        if tp_dim is None:
            return full
        start, length = _chunk_bounds(full.shape[tp_dim], self.t, self.tp_index)
        return full.narrow(tp_dim, start, length)

    def _lower_bound(self, shape: torch.Size, dtype: torch.dtype, tp_dim: int | None, own: tuple[int, int]) -> int:
        """Bytes of the target shard not inside this rank's own rows [own[0], own[0] + own[1])."""
        rows = shape[0]
        row_elems = math.prod(shape[1:])
        lo, hi = 0, rows
        if tp_dim == 0:
            lo, n = _chunk_bounds(rows, self.t, self.tp_index)
            hi = lo + n
        elif tp_dim is not None:
            row_elems = row_elems // shape[tp_dim] * _chunk_bounds(shape[tp_dim], self.t, self.tp_index)[1]
        overlap = max(0, min(hi, own[0] + own[1]) - max(lo, own[0]))
        return (hi - lo - overlap) * row_elems * dtype.itemsize

    def _from_fsdp(self, name: str, p: DTensor, tp_dim: int | None) -> tuple[torch.Tensor, int]:
        fsdp_ranks = p.device_mesh.mesh.tolist()
        n = len(fsdp_ranks)
        rows = p.shape[0]
        c = -(-rows // n)
        k = fsdp_ranks.index(dist.get_rank())
        local = p.to_local().detach()
        if local.shape[0] != _chunk_bounds(rows, n, k)[1]:
            raise ValueError(
                f"parameter {name!r}: local shard has {local.shape[0]} rows, expected FSDP2 chunk {k} of {rows}"
            )
        dtype = self.dtype or p.dtype
        self.stats.lower_bound_bytes += self._lower_bound(p.shape, dtype, tp_dim, (k * c, local.shape[0]))

        if tp_dim is not None and tp_dim > 0:
            return self._rowwise(p, local, tp_dim, c, fsdp_ranks)
        if tp_dim == 0 and self._aligned(rows, c, fsdp_ranks):
            dp = len(self.dp_ranks)
            shard = self._gather_rows(local, c, self.dp_group, dp, self.dp_index)  # exactly my TP shard (+ padding)
            return shard.narrow(0, 0, _chunk_bounds(rows, self.t, self.tp_index)[1]), shard.nbytes
        full = self._gather_rows(local, c, p.device_mesh.get_group(), n, k)
        return self._tp_slice(full.narrow(0, 0, rows), tp_dim), full.nbytes

    def _aligned(self, rows: int, c: int, fsdp_ranks: list[int]) -> bool:
        """True when my micro-DP group's FSDP chunks, in dp order, are exactly my TP shard's rows."""
        d = len(self.dp_ranks)
        in_order = [fsdp_ranks.index(r) for r in self.dp_ranks] == [self.tp_index * d + i for i in range(d)]
        return in_order and -(-rows // self.t) == d * c

    def _rowwise(self, p: DTensor, local: torch.Tensor, tp_dim: int, c: int, fsdp_ranks: list[int]):
        """Exchange column blocks inside the TP group, then all-gather rows inside the micro-DP group.

        After the gather, block (dp i, tp k) holds FSDP chunk ``fsdp_ranks.index(grid[i][k])``; the
        blocks are put in chunk order in place (cycle by cycle, one block of scratch).
        """
        t, d = self.t, len(self.dp_ranks)
        cols = p.shape[tp_dim]
        cc = -(-cols // t)
        piece_shape = (c, *p.shape[1:tp_dim], cc, *p.shape[tp_dim + 1 :])
        dtype = self.dtype or p.dtype
        send = local.new_zeros((t, *piece_shape), dtype=dtype, device=self.device)  # send[k]: my rows, TP shard k's columns
        self.stats.alloc(send.nbytes)
        for k in range(t):
            start, length = _chunk_bounds(cols, t, k)
            send[k, : local.shape[0]].narrow(tp_dim, 0, length).copy_(local.narrow(tp_dim, start, length))
        out = send.new_empty((d, t, *piece_shape))  # out[i]: what dp peer i received in the exchange
        self.stats.alloc(out.nbytes)
        recv = out[self.dp_index]  # recv[k]: rows of my TP peer k, my columns
        if t > 1:
            dist.all_to_all_single(recv, send, group=self.tp_group)
        else:
            recv.copy_(send)
        self.stats.bytes_received += (t - 1) * send[0].nbytes
        self.stats.free(send.nbytes)
        del send
        if d > 1:
            flat = (-1, *piece_shape[1:])
            _all_gather_single(out.view(flat), recv.view(flat), group=self.dp_group)
        self.stats.bytes_received += (d - 1) * recv.nbytes
        blocks = out.view(d * t, -1)
        permute_blocks(blocks, [fsdp_ranks.index(r) for row in self.grid for r in row], self.stats)
        out_cols = _chunk_bounds(cols, t, self.tp_index)[1]
        full_rows = out.view(d * t * c, *piece_shape[1:])
        return full_rows.narrow(0, 0, p.shape[0]).narrow(tp_dim, 0, out_cols), out.nbytes

    def _tp_placement_matches(self, p: DTensor, tp_dim: int | None) -> bool:
        want = Replicate() if tp_dim is None else Shard(tp_dim)
        return p.device_mesh.ndim == 2 and p.placements[1] == want

    def _from_training_tp(self, p: DTensor) -> tuple[torch.Tensor, int]:
        """2-D training param on the generation mesh: gather the FSDP dim, keep the TP shard."""
        p = p.detach()
        before = p.to_local()
        if p.device_mesh.size(0) == 1:  # nothing sharded on dp: the TP shard is already here
            out = before
        else:
            out = p.redistribute(p.device_mesh, [Replicate(), p.placements[1]]).to_local()
        if self.dtype is not None:
            out = out.to(self.dtype)
        own = out.untyped_storage().data_ptr() == before.untyped_storage().data_ptr()
        nbytes = 0 if own else out.nbytes
        self.stats.alloc(nbytes)
        missing = out.nbytes - before.numel() * out.dtype.itemsize  # the FSDP shards of my dp peers
        self.stats.lower_bound_bytes += missing
        self.stats.bytes_received += missing
        return out, nbytes

    def _from_dp_only(self, p: DTensor) -> tuple[torch.Tensor, int]:
        """A replicated parameter FSDP-sharded over my micro-DP group only (the norms of FSDP2 × TP training)."""
        local = p.to_local().detach()
        d = len(self.dp_ranks)
        self.stats.lower_bound_bytes += (p.numel() - local.numel()) * (self.dtype or p.dtype).itemsize
        if d == 1 and self.dtype in (None, local.dtype):
            return local, 0
        full = self._gather_rows(local, -(-p.shape[0] // d), self.dp_group, d, self.dp_index)
        return full.narrow(0, 0, p.shape[0]), full.nbytes

    def _from_full(self, p: DTensor, tp_dim: int | None) -> tuple[torch.Tensor, int]:
        """Fallback for layouts without a direct route: materialise the full parameter, then slice."""
        full = p.detach().full_tensor()
        if self.dtype is not None:
            full = full.to(self.dtype)
        self.stats.alloc(full.nbytes)
        self.stats.bytes_received += full.nbytes - p.to_local().numel() * full.dtype.itemsize
        target = self._tp_slice(full, tp_dim)
        self.stats.lower_bound_bytes += max(0, target.nbytes - p.to_local().numel() * full.dtype.itemsize)
        return target, full.nbytes


@torch.no_grad()
def iter_generation_weights(
    model: nn.Module,
    gen_mesh: DeviceMesh,
    tp_dim_of: TpDimFn,
    *,
    dtype: torch.dtype | None = None,
    stats: ReshardStats | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, local generation-layout tensor)`` for every parameter of `model`, streamed.

    Args:
        model: the training model (FSDP2 / FSDP2 × TP DTensor parameters, or plain tensors).
        gen_mesh: the ("dp", "tp") generation mesh (`layout.generation_mesh`).
        tp_dim_of: HF parameter name -> the dim it is TP-sharded on in generation (None: replicated).
        dtype: cast shards to this dtype before they travel (e.g. bf16 generation from fp32 training).
        stats: filled in as the stream goes (pass one to read it after the loop).

    Tied parameters appear once, under their first name (``model.named_parameters()`` order).
    At most one parameter's transient buffers are alive at any time.
    """
    stats = stats if stats is not None else ReshardStats()
    resharder = _Resharder(gen_mesh, tp_dim_of, dtype, stats)
    start = time.perf_counter()
    for name, p in model.named_parameters():
        tensor, nbytes = resharder.convert(name, p)
        stats.num_tensors += 1
        stats.largest_tensor_bytes = max(stats.largest_tensor_bytes, tensor.nbytes)
        stats.seconds = time.perf_counter() - start
        yield name, tensor
        del tensor
        stats.free(nbytes)
    stats.seconds = time.perf_counter() - start
