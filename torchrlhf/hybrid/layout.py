"""The generation layout: which ranks form tensor-parallel and micro data-parallel groups.

Training shards every parameter on dim 0 over the FSDP2 mesh of N ranks
(rank k holds rows ``[k*c, (k+1)*c)``, ``c = ceil(rows / N)``). Generation uses
TP size ``t`` and micro-DP size ``d = N // t``. A column-parallel weight's TP shard
``j`` is rows ``[j*rows/t, (j+1)*rows/t)``, which is exactly the union of the
training shards of ranks ``j*d .. j*d + d - 1``. So the HybridFlow grouping is:

    tp_rank(r) = r // d          micro-DP group of r = ranks {j*d .. j*d + d - 1}, j = r // d
    dp_rank(r) = r % d           TP group of r       = ranks {r % d + k*d for k < t}

i.e. micro-DP groups are *contiguous* ranks and TP groups are *strided*. Each
rank's generation shard then contains its training shard, and building it
needs only an all-gather inside the micro-DP group (no bytes cross micro-DP
groups for column-parallel weights). The common "TP groups are adjacent ranks"
grouping would instead make every rank fetch rows it does not hold from ranks
of other groups.

Row-parallel weights (split on dim 1) and replicated ones need every row, so
with dim-0 FSDP shards some bytes must cross micro-DP groups whatever the
grouping; `reshard` moves exactly the missing bytes for them too (an all-to-all
inside the TP group, then the micro-DP all-gather).

When training already uses TP of the same size, the generation mesh is the
training (dp, tp) mesh itself: TP shards are reused and only the FSDP
all-gather over dp remains (nothing at all when dp == 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from torchrlhf.runtime.mesh import build_mesh
from torchrlhf.runtime.parallel_dims import ParallelDims


def suffix_tp_dims(table: Mapping[str, int]) -> Callable[[str], int | None]:
    """name -> TP dim from a table keyed by HF name suffix (e.g. ``"mlp.down_proj.weight": 1``); absent = replicated."""

    def tp_dim(name: str) -> int | None:
        for suffix, dim in table.items():
            if name == suffix or name.endswith("." + suffix):
                return dim
        return None

    return tp_dim


def training_mesh(model: nn.Module) -> DeviceMesh | None:
    """The model's training mesh: the widest mesh of its DTensor parameters (None when it has none).

    FSDP2 alone: the 1-D dp mesh. FSDP2 × TP: the 2-D ("dp", "tp") mesh (norms live on its dp sub-mesh).
    """
    meshes = [p.device_mesh for p in model.parameters() if isinstance(p, DTensor)]
    return max(meshes, key=lambda m: m.ndim) if meshes else None


def generation_mesh(train_mesh: DeviceMesh, tp_size: int) -> DeviceMesh:
    """The 2-D ("dp", "tp") generation mesh on the ranks of `train_mesh`, grouped as the module docstring says.

    `train_mesh` is the FSDP2 mesh (1-D), or a 2-D ("dp", "tp") training mesh. For a 2-D training mesh
    with the same TP size the training mesh is returned (TP shards are reused as they are). Collective:
    every rank of `train_mesh` must call it the first time; the mesh factory caches it, so the engine and
    the resharder share one set of process groups.
    """
    if train_mesh.ndim == 2 and train_mesh.mesh_dim_names == ("dp", "tp") and train_mesh.size(1) == tp_size:
        return train_mesh
    ranks = train_mesh.mesh.flatten()  # FSDP shard order: the rank that holds chunk k is ranks[k]
    dims = ParallelDims(ranks.numel(), tp=tp_size)  # the sizes, checked; the grouping is strided, as above
    layout = ranks.view(dims.tp, dims.dp).t().contiguous()  # layout[i, j] = ranks[j*d + i]: dp i, tp j
    group = train_mesh.get_group() if train_mesh.ndim == 1 else None
    return build_mesh(layout, ("dp", "tp"), train_mesh.device_type, group=group)
