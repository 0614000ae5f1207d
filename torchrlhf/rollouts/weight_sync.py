"""Controller side of split placement: after each actor update, the new weights go to the rollout ranks.

The controller only starts the two collective halves (`ActorWorker.send_weights` and
`RolloutWorker.receive_weights`) and waits for both; the bytes move by broadcast on a process group
made of the actor's first rank and the rollout ranks (`torchrlhf.hybrid.broadcast`).

When rollout replicas may be lost (asynchronous training, `Replicas.lose_replicas`), a sync that fails
because a rollout rank died gives that replica up, rebuilds the sync group from the ranks still alive
(every live rank takes part in creating it; the dead one cannot) and sends again. The actor ranks finish every failed sync
together (`send_weights` keeps gathering), and each receive lands in its own relay inbox, so a sync
abandoned half way changes nothing.
"""

from __future__ import annotations

from typing import Any

from torchrlhf.hybrid.broadcast import sync_group_ranks
from torchrlhf.rollouts.replicas import Replicas
from torchrlhf.runtime.futures import WorkerError, wait_all
from torchrlhf.runtime.group import new_process_group


class WeightSync:
    """Pushes the actor group's weights to a rollout group on other ranks; one call per new version."""

    KEY = "weight_sync:actor->rollout"

    def __init__(self, actor: Any, replicas: Replicas, *, dtype: str, bucket_bytes: int, relay_capacity: int = 2) -> None:
        """``replicas``: the rollout group; a sync that fails because a rollout rank died gives its replica up
        when `Replicas` may lose replicas."""
        self.actor, self.replicas, self.rollout = actor, replicas, replicas.group
        self.dtype, self.bucket_bytes, self.relay_capacity = dtype, bucket_bytes, relay_capacity
        self.key, self._members, self._rebuilds = self.KEY, sync_group_ranks(actor.ranks, self.rollout.ranks), 0
        new_process_group(self.key, self._members)
        self.manifest = actor.weight_manifest()

    def __call__(self, version: int, to_relay: bool = False) -> dict[str, float]:
        """Send the actor's current weights, tagged ``version``; returns ``weight_sync/*`` metrics.

        ``to_relay`` (asynchronous training): into the rollout ranks' `WeightRelay`, while they generate.
        """
        while True:
            self._follow_lost_replicas()
            try:
                sent, _ = wait_all(
                    self.actor.send_weights.async_(self.key, self.manifest, self.dtype, self.bucket_bytes),
                    self.rollout.receive_weights.async_(self.key, self.actor.ranks[0], self.manifest,
                                                        self.bucket_bytes, version,
                                                        self.relay_capacity if to_relay else 0),
                )
            except WorkerError:
                if not self.replicas.lost(self._members[1:]):
                    raise  # an actor rank failed, or nothing died: the job ends with the error
                continue
            return {"weight_sync/bytes": sent["bytes"], "weight_sync/buckets": sent["buckets"],
                    "weight_sync/send_s": sent["seconds"]}

    def _follow_lost_replicas(self) -> None:
        """After rollout replicas were lost, sync over a new group of the live ranks only."""
        members = sync_group_ranks(self.actor.ranks, self.rollout.live_ranks)
        if members != self._members:
            self._rebuilds += 1
            self.key, self._members = f"{self.KEY}#{self._rebuilds}", members
            new_process_group(self.key, members)
