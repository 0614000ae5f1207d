"""The weight relay of asynchronous training (Laminar's design): new versions wait on the rollout side.

With ``trainer.mode: async`` the actor does not push weights into the rollout engines, which are busy
generating; it broadcasts each new version once into a `WeightRelay` in the CPU memory of every
rollout rank (`hybrid.broadcast.receive_weights` fills one inbox per sync, like an engine, and the inbox
is published as that version once complete). The engine loads from its local relay at a trajectory
boundary, i.e. between two generate calls (with partial rollouts also between two decode steps), so
neither side waits for the other: the actor only waits for the bytes to arrive, the engine only for a
local copy.

A relay keeps a few versions (``capacity``): the deterministic schedule asks for an exact older version
while a newer one is already there. Loading a version forgets every older one, unless the loader asks to
keep them (a repack target continues samples of several versions).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch


class WeightRelay:
    """Versions of one engine's weights (this rank's TP shards), received in the background.

    Args:
        engine: the rollout engine the versions are for; its TP layout decides the shards kept.
        capacity: versions kept at most; publishing past it forgets the oldest.
    """

    def __init__(self, engine, capacity: int = 2) -> None:
        if capacity < 1:
            raise ValueError(f"relay capacity must be >= 1, got {capacity}")
        self.tp_size, self.tp_mesh = engine.tp_size, engine.tp_mesh
        self._dims = engine.param_shard_dims()
        self.capacity = capacity
        self._versions: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._changed = threading.Condition()

    # -------------------------------------------------------------- receiving side
    def inbox(self) -> "_Inbox":
        """Where one sync's tensors land (an engine stand-in for `hybrid.broadcast.receive_weights`); each
        sync has its own, so a sync abandoned half way (its sender died) cannot mix into the next one."""
        return _Inbox(self._dims, self.tp_size, self.tp_mesh)

    def publish(self, version: int, inbox: "_Inbox") -> None:
        """The tensors of ``inbox`` are ``version``; engines may load it now."""
        with self._changed:
            self._versions[version] = inbox.tensors
            while len(self._versions) > self.capacity:
                del self._versions[min(self._versions)]
            self._changed.notify_all()

    # -------------------------------------------------------------- engine side
    def versions(self) -> list[int]:
        with self._changed:
            return sorted(self._versions)

    def newest(self) -> int | None:
        with self._changed:
            return max(self._versions, default=None)

    def load(self, engine, version: int | None = None, timeout: float = 600.0, forget_older: bool = True) -> int:
        """Copy ``version`` (None: the newest) into ``engine``; returns the version loaded.

        Waits up to ``timeout`` seconds for an exact version that is still on its way. ``forget_older``
        False keeps the older versions (a repack target continues samples of several versions).
        """
        with self._changed:
            if version is not None and self._versions and version < min(self._versions):
                raise LookupError(f"weight version {version} left the relay (it holds {sorted(self._versions)}); "
                                  "raise its capacity")
            ready = self._changed.wait_for(
                lambda: (version in self._versions) if version is not None else bool(self._versions), timeout)
            if not ready:
                raise TimeoutError(f"weight version {version} did not reach the relay in {timeout}s "
                                   f"(it holds {sorted(self._versions)})")
            version = max(self._versions) if version is None else version
            tensors = self._versions[version]
            for old in [v for v in self._versions if v < version and forget_older]:
                del self._versions[old]
        engine.update_weights(tensors)
        return version


class _Inbox:
    """The receiving end of one sync: keeps own copies of the stream's tensors (the sender's buckets are
    reused)."""

    def __init__(self, dims: dict[str, int | None], tp_size: int, tp_mesh) -> None:
        self._dims, self.tp_size, self.tp_mesh = dims, tp_size, tp_mesh  # what `receive_weights` shards by
        self.tensors: list[tuple[str, torch.Tensor]] = []

    def param_shard_dims(self) -> dict[str, int | None]:
        return self._dims

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.tensors.extend((name, tensor.clone()) for name, tensor in named_tensors)
