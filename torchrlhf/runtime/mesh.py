"""The one mesh factory: every DeviceMesh (training dp × tp, generation tp × micro-dp, tests' world
meshes) and its process groups are made here, once per layout, and cached for the run.

A mesh is given by its layout, a tensor of global ranks (``layout[i, j]`` is the rank at coordinates
``(i, j)``), so any grouping is expressible: row-major worker-group meshes and the strided HybridFlow
generation layout alike. Each rank creates only the groups it belongs to, with
``use_local_synchronization``, so ranks outside the mesh (other roles in split placement) never take
part. That naming scheme hashes a group's ranks with the number of groups the rank already holds, so
ranks holding different numbers of groups would never meet: when a process group over exactly the
mesh's ranks is known, placeholder groups first even out the counts (`equalize_group_counts`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _world

_meshes: dict[tuple, DeviceMesh] = {}


def build_mesh(
    layout: torch.Tensor,
    names: tuple[str, ...],
    device_type: str,
    *,
    group: dist.ProcessGroup | None = None,
) -> DeviceMesh:
    """The DeviceMesh of ``layout`` (global ranks) with dimension ``names``; cached by layout and names.

    Collective over the layout's ranks the first time. ``group``: a process group over exactly those ranks
    (reused as the mesh's group when the mesh is 1-D; used to even out group counts otherwise).
    """
    layout = torch.as_tensor(layout, dtype=torch.long)
    if len(names) != layout.ndim:
        raise ValueError(f"mesh layout of shape {tuple(layout.shape)} needs {layout.ndim} names, got {names}")
    flat = layout.flatten().tolist()
    if len(set(flat)) != len(flat):
        raise ValueError(f"mesh layout {layout.tolist()} repeats a rank")
    me = dist.get_rank()
    if me not in flat:
        raise ValueError(f"rank {me} is not in the mesh layout {layout.tolist()}")
    key = (tuple(flat), tuple(layout.shape), tuple(names), device_type)
    if key in _meshes:
        return _meshes[key]
    if layout.ndim == 1 and group is not None:
        mesh = DeviceMesh.from_group(group, device_type, mesh_dim_names=tuple(names))
    else:
        if group is not None:
            equalize_group_counts(group)
        groups = []
        for dim in range(layout.ndim):
            rows = layout.movedim(dim, -1).reshape(-1, layout.shape[dim]).tolist()
            mine = next(r for r in rows if me in r)
            groups.append(dist.new_group(mine, use_local_synchronization=True))
        mesh = DeviceMesh.from_group(groups if layout.ndim > 1 else groups[0], device_type, mesh=layout,
                                     mesh_dim_names=tuple(names))
    _meshes[key] = mesh
    return mesh


def equalize_group_counts(pg: dist.ProcessGroup) -> None:
    """Make every rank of ``pg`` hold the same number of process groups (collective over ``pg``).

    One-rank placeholder groups (no peers, no sockets) even out the counts, so that the next
    ``new_group(use_local_synchronization=True)`` calls name their groups alike on every rank.
    """
    count = torch.tensor([len(_world.pg_names)])
    target = count.clone()
    dist.all_reduce(target, op=dist.ReduceOp.MAX, group=pg)
    for _ in range(int(target - count)):
        dist.new_group([dist.get_rank()], use_local_synchronization=True)


def forget_meshes() -> None:
    """Drop the cache (its process groups end with the run)."""
    _meshes.clear()
