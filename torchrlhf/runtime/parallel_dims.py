"""`ParallelDims`: how a worker group's ranks divide into data-parallel replicas of tensor-parallel ranks.

One value per worker group, given by the controller (the recipe's `torchrlhf.trainer.schema.role_layouts`) to
its `WorkerGroup`, which hands it to every worker of the group in its context. The dispatch (which
ranks share a data shard, whose answer is collected), the workers' ``dp_rank``/``dp_size`` and their
(dp, tp) meshes all read it, so the rank arithmetic exists here only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchrlhf.runtime.mesh import build_mesh


@dataclass(frozen=True)
class ParallelDims:
    """``world`` ranks as ``dp`` data-parallel replicas of ``tp`` tensor-parallel ranks each (and, for a
    mixture-of-experts model, experts split over ``ep`` adjacent data-parallel ranks: `build_expert_mesh`).

    The ranks of one TP group are adjacent: group rank ``r`` is ``(dp_rank, tp_rank) = divmod(r, tp)``.
    They receive the same data shard, and the replica's first rank (``tp_rank`` 0) answers for it.
    """

    world: int
    tp: int = 1
    ep: int = 1  # expert parallelism: a mixture-of-experts model's experts split over ``ep`` adjacent dp ranks

    def __post_init__(self) -> None:
        for name in ("world", "tp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive int, got {value!r}")
        if self.world % self.tp:
            raise ValueError(f"tensor-parallel size {self.tp} must divide the group's {self.world} ranks")
        if self.ep > 1 and self.tp > 1:
            raise ValueError(f"expert parallelism (ep {self.ep}) with tensor parallelism (tp {self.tp}) is not "
                             "supported: use tp 1")
        if self.dp % self.ep:
            raise ValueError(f"expert-parallel size {self.ep} must divide the group's {self.dp} data-parallel ranks")

    @property
    def dp(self) -> int:
        return self.world // self.tp

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of group rank ``rank``."""
        if not 0 <= rank < self.world:
            raise ValueError(f"group rank {rank} is outside the group's {self.world} ranks")
        return divmod(rank, self.tp)

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank)[0]

    def tp_rank(self, rank: int) -> int:
        return self.coords(rank)[1]

    def replica(self, dp_rank: int) -> list[int]:
        """The group ranks of data-parallel replica ``dp_rank``; the first answers for it."""
        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank {dp_rank} is outside the group's {self.dp} data-parallel replicas")
        return list(range(dp_rank * self.tp, (dp_rank + 1) * self.tp))

    def build_meshes(
        self, ranks: Sequence[int], device_type: str, group: dist.ProcessGroup | None = None
    ) -> tuple[DeviceMesh, DeviceMesh | None]:
        """(dp_mesh, tp_mesh) over ``ranks`` (the group's global ranks, in group order); tp_mesh is None
        without TP. Made by the one mesh factory (`runtime.mesh.build_mesh`), so collective over ``ranks``
        the first time and cached after; ``group``: a process group over exactly ``ranks``."""
        ranks = list(ranks)
        if len(ranks) != self.world:
            raise ValueError(f"{self} lays out {self.world} ranks, got {len(ranks)}: {ranks}")
        if self.tp == 1:
            return build_mesh(torch.tensor(ranks), ("dp",), device_type, group=group), None
        mesh = build_mesh(torch.tensor(ranks).view(self.dp, self.tp), ("dp", "tp"), device_type, group=group)
        return mesh["dp"], mesh["tp"]

    def build_expert_mesh(
        self, ranks: Sequence[int], device_type: str, group: dist.ProcessGroup | None = None
    ) -> DeviceMesh | None:
        """The ``("dp_mod_ep", "ep")`` mesh over ``ranks`` (None without expert parallelism): ``ep`` adjacent
        data-parallel ranks split the experts, and each expert's shards spread over the ``dp_mod_ep`` ranks
        that hold the same experts. Collective over ``ranks`` the first time, like `build_meshes`."""
        if self.ep == 1:
            return None
        ranks = list(ranks)
        layout = torch.tensor(ranks).view(self.dp // self.ep, self.ep)
        return build_mesh(layout, ("dp_mod_ep", "ep"), device_type, group=group)
