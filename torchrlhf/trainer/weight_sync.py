"""Controller side of split placement: after each actor update, the new weights go to the rollout ranks.

The controller only starts the two collective halves (`ActorWorker.send_weights` and
`RolloutWorker.receive_weights`) and waits for both; the bytes move by broadcast on a process group
made of the actor's first rank and the rollout ranks (`torchrlhf.hybrid.broadcast`).
"""

from __future__ import annotations

from typing import Any

from torchrlhf.hybrid.broadcast import sync_group_ranks
from torchrlhf.runtime.group import new_process_group, wait_all


class WeightSync:
    """Pushes the actor group's weights to a rollout group on other ranks; one call per new version."""

    KEY = "weight_sync:actor->rollout"

    def __init__(self, actor: Any, rollout: Any, *, dtype: str, bucket_bytes: int, relay_capacity: int = 2) -> None:
        self.actor, self.rollout = actor, rollout
        self.dtype, self.bucket_bytes, self.relay_capacity = dtype, bucket_bytes, relay_capacity
        new_process_group(self.KEY, sync_group_ranks(actor.ranks, rollout.ranks))
        self.manifest = actor.weight_manifest()

    def __call__(self, version: int, to_relay: bool = False) -> dict[str, float]:
        """Send the actor's current weights, tagged ``version``; returns ``weight_sync/*`` metrics.

        ``to_relay`` (asynchronous training): into the rollout ranks' `WeightRelay`, while they generate.
        """
        sent, _ = wait_all(
            self.actor.send_weights.async_(self.KEY, self.manifest, self.dtype, self.bucket_bytes),
            self.rollout.receive_weights.async_(self.KEY, self.actor.ranks[0], self.manifest, self.bucket_bytes,
                                                version, self.relay_capacity if to_relay else 0),
        )
        return {"weight_sync/bytes": sent["bytes"], "weight_sync/buckets": sent["buckets"],
                "weight_sync/send_s": sent["seconds"]}
