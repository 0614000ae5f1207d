"""The rollout group as the controller drives it: generation on every replica or on one, and the one rule
for giving up a replica whose process died."""

from __future__ import annotations

from typing import Any

from torchrlhf.data import Batch
from torchrlhf.generation.sampling import SamplingParams
from torchrlhf.generation.base import concat_generations
from torchrlhf.rollouts.batches import split_even
from torchrlhf.runtime.futures import WorkerError


class Replicas:
    """The data-parallel replicas of the rollout group (each a `RolloutWorker` on ``tp_size`` ranks).

    Colocated with the actor (the hybrid engine), a generation is one collective call over every rank (each
    rank streams its training shards into its engine). On ranks of their own, the replicas are independent:
    a batch is split evenly over the live ones, or one replica takes a call of its own (the stream
    schedule). With ``lose_replicas`` (asynchronous training), a replica whose process died is dropped and
    the work goes on without it (`lost`).
    """

    def __init__(self, group: Any, *, colocated: bool, pad_id: int, lose_replicas: bool = False) -> None:
        self.group, self.colocated, self.pad_id, self.lose_replicas = group, colocated, pad_id, lose_replicas
        self._busy_mark: dict[int, tuple[float, float]] = {}  # rank -> (its clock, its busy seconds)
        self.requeued = 0  # prompts generated again because their replica was lost

    @property
    def live(self) -> list[int]:
        """The data-parallel replicas still serving."""
        return self.group.live_dp_ranks

    def lost(self, ranks: list[int]) -> bool:
        """A call to global ``ranks`` failed: True if one of their replicas lost a rank and is now dropped
        (`WorkerGroup.drop_dead`), so the work may go again to the live replicas; False if the error must
        end the run. The error need not come from the dead rank: a TP peer's collective can fail first."""
        return self.lose_replicas and self.group.drop_dead(ranks)

    def generate(self, prompts: Batch, sampling: SamplingParams, *, version: int) -> Batch:
        """``sampling.n`` responses per prompt from every live replica, in prompt order, with weight ``version``.

        Split placement: when a replica dies (and losing replicas is allowed) the others finish their shares,
        then the whole batch goes again to the survivors, with the same version.
        """
        if self.colocated:
            return self.group.generate(prompts, sampling, version=version)
        while True:
            live = self.live
            futures = [(d, self.group.call_dp(d, "generate", shard, sampling, version=version))
                       for d, shard in zip(live, split_even(prompts, len(live))) if len(shard)]
            outputs, errors = [], []
            for _, fut in futures:  # every call ends before any goes again: a replica runs one generate at a time
                try:
                    outputs.append(fut.wait())
                except WorkerError as e:
                    errors.append(e)
            if not errors:
                return concat_generations(outputs, self.pad_id)
            if not all(self.lost([e.rank]) for e in errors):
                raise errors[0]
            self.requeued += len(prompts)

    def generate_on(self, replica: int, prompts: Batch, sampling: SamplingParams, *, version: int,
                    partial: bool = False, **repack: Any) -> Batch:
        """Replica ``replica`` alone generates ``prompts`` (raises `WorkerError` naming the rank if it fails);
        ``repack``: ``release_below`` / ``joinable`` (`RolloutWorker.generate`)."""
        return self.group.call_dp(replica, "generate", prompts, sampling, version=version, partial=partial,
                                  **repack).wait()

    def busy_metrics(self) -> dict[str, float]:
        """Split placement: the share of wall time since the last call that the rollout ranks spent in
        ``generate`` (each rank's busy seconds over its own clock's interval)."""
        if self.colocated:
            return {}
        ranks = self.group.live_ranks
        try:
            answers = self.group.busy_seconds()
        except WorkerError:
            if not self.lost(ranks):
                raise
            return {}  # a rollout rank just died
        busy = {r: (clock, float(b.get("generate", 0.0))) for r, (clock, b) in zip(ranks, answers)}
        mark, self._busy_mark = self._busy_mark, busy
        fractions = [(b - mark[r][1]) / max(clock - mark[r][0], 1e-9) for r, (clock, b) in busy.items() if r in mark]
        if not fractions:
            return {}
        return {"rollout/busy_fraction": sum(fractions) / len(fractions), "rollout/busy_fraction_min": min(fractions)}

    def loss_metrics(self) -> dict[str, float]:
        """Rollout ranks no longer generating (a dead rank's whole replica) and prompts generated again."""
        return {"async/lost_rollout_ranks": float(len(self.group.ranks) - len(self.group.live_ranks)),
                "async/requeued_in_flight": float(self.requeued)}
