"""How a group call fans out and how its answers come back: one table, `DISPATCH`, ``{Dispatch: (split, collect)}``.

A split turns the controller's arguments into one ``(args, kwargs, want_answer)`` per rank called and says
which of the ranks' results are the answers; the collect combines the answers (a method's ``collect=``
replaces it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torchrlhf.data.batch import Batch
from torchrlhf.runtime.worker import Dispatch

PerRank = list[tuple[tuple, dict, bool]]  # per rank called: (args, kwargs, whether its answer is wanted)
Select = Callable[[list[Any]], list[Any]]  # the ranks' results -> the answers to collect


@dataclass
class CallLayout:
    """Whom a call reaches: the group's ranks by index, skipping lost replicas."""

    called: list[int]  # group indices of the ranks called
    replica_of: list[int]  # every group index's data-parallel replica
    leaders: list[int]  # every replica's answering group index
    live_replicas: list[int]

    @property
    def all_live(self) -> bool:
        return len(self.live_replicas) == len(self.leaders)


def _all(results: list[Any]) -> list[Any]:
    return results


def split_same(where: str, args: tuple, kwargs: dict, layout: CallLayout) -> tuple[PerRank, Select]:
    """ONE_TO_ALL: the same arguments to every rank; every rank's answer."""
    return [(args, kwargs, True)] * len(layout.called), _all


def split_rank_zero(where: str, args: tuple, kwargs: dict, layout: CallLayout) -> tuple[PerRank, Select]:
    """RANK_ZERO: every rank runs it (SPMD); only the first rank's answer comes back."""
    return [(args, kwargs, k == 0) for k in range(len(layout.called))], _all


def split_per_rank(where: str, args: tuple, kwargs: dict, layout: CallLayout) -> tuple[PerRank, Select]:
    """ALL_TO_ALL: every argument is a list with one entry per rank."""
    n = len(layout.called)
    if not layout.all_live:
        raise RuntimeError(f"{where}: ALL_TO_ALL needs every rank; some replicas of this group are lost")
    for key, v in [*enumerate(args), *kwargs.items()]:
        if not isinstance(v, (list, tuple)):
            raise TypeError(f"{where} (ALL_TO_ALL): argument {key!r} must be a list with one entry per rank")
        if len(v) != n:
            raise ValueError(f"{where} (ALL_TO_ALL): argument {key!r} has {len(v)} entries, the group has {n} ranks")
    return [(tuple(a[i] for a in args), {k: v[i] for k, v in kwargs.items()}, True) for i in range(n)], _all


def split_dp(where: str, args: tuple, kwargs: dict, layout: CallLayout) -> tuple[PerRank, Select]:
    """DP_COMPUTE: every Batch argument split into one shard per live replica (padded to equal shards; the
    padding rows are stripped from the answers); other arguments go to every rank. One answer per replica,
    its leader's; metric answers of all-padding shards are dropped."""
    batches = {**{i: a for i, a in enumerate(args) if isinstance(a, Batch)},
               **{k: v for k, v in kwargs.items() if isinstance(v, Batch)}}
    if not batches:
        got = [type(v).__name__ for v in (*args, *kwargs.values())]
        raise TypeError(f"{where} (DP_COMPUTE): an argument must be a Batch (the data split over replicas), got {got}")
    sizes = {k: len(b) for k, b in batches.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{where} (DP_COMPUTE): Batch arguments differ in size: {sizes}")
    total = next(iter(sizes.values()))
    if total == 0:
        raise ValueError(f"{where} (DP_COMPUTE): got an empty Batch")
    replicas = layout.live_replicas
    dp = len(replicas)
    slot = {d: j for j, d in enumerate(replicas)}
    shards = {k: b.pad_to_multiple(dp)[0].chunk(dp) for k, b in batches.items()}
    shard_size = -(-total // dp)
    real = [max(0, min(shard_size, total - j * shard_size)) for j in range(dp)]  # non-padding rows per shard
    per_rank = []
    for i in layout.called:
        j = slot[layout.replica_of[i]]
        a = tuple(shards[x][j] if x in shards else v for x, v in enumerate(args))
        kw = {k: (shards[k][j] if k in shards else v) for k, v in kwargs.items()}
        per_rank.append((a, kw, i in layout.leaders))
    positions = [layout.called.index(layout.leaders[d]) for d in replicas]  # answer positions of the leaders

    def select(results: list[Any]) -> list[Any]:
        answers = [(_strip_padding(results[positions[j]], real[j], shard_size), real[j]) for j in range(dp)]
        return [a for a, r in answers if r > 0 or not isinstance(a, Mapping)]

    return per_rank, select


def _strip_padding(answer: Any, real: int, shard_size: int) -> Any:
    """Drop the rows that came from padding samples (answers may hold k rows per input sample)."""
    if not isinstance(answer, Batch) or real == shard_size:
        return answer
    if len(answer) % shard_size:
        raise ValueError(
            f"cannot strip DP padding: a shard of {shard_size} samples returned a Batch of {len(answer)} rows"
        )
    return answer[: real * (len(answer) // shard_size)]


def mean_metrics(answers: list[Mapping[str, Any]]) -> dict[str, float]:
    keys = set(answers[0])
    for a in answers[1:]:
        if set(a) != keys:
            raise ValueError(f"metric dicts of the DP ranks disagree on keys: {sorted(keys)} vs {sorted(a)}")
    return {k: sum(float(a[k]) for a in answers) / len(answers) for k in answers[0]}


def collect_dp(answers: list[Any]) -> Any:
    """Batches concatenated, metric dicts averaged, None when every replica returned None."""
    if all(a is None for a in answers):
        return None
    if all(isinstance(a, Batch) for a in answers):
        return Batch.concat(answers)
    if all(isinstance(a, Mapping) for a in answers):
        return mean_metrics(answers)
    return answers


def first(answers: list[Any]) -> Any:
    return answers[0]


DISPATCH: dict[Dispatch, tuple[Callable[..., tuple[PerRank, Select]], Callable[[list[Any]], Any]]] = {
    Dispatch.ONE_TO_ALL: (split_same, list),
    Dispatch.RANK_ZERO: (split_rank_zero, first),
    Dispatch.ALL_TO_ALL: (split_per_rank, list),
    Dispatch.DP_COMPUTE: (split_dp, collect_dp),
}

NAMED_COLLECTS: dict[str, Callable[[list[Any]], Any]] = {
    "concat": Batch.concat,
    "mean": mean_metrics,
    "list": list,
    "first": first,
}
