"""Batch-size bookkeeping and micro-batching for the SPMD training workers.

Sizes in configs are global and counted in prompts; these helpers turn them into
per-rank sample counts, check that they divide before any work starts, and cut a
rank's samples into micro-batches: fixed-size, or token-balanced under a token
budget (``use_dynamic_bsz``). The number of micro-batches is agreed across the
data-parallel group, because every FSDP forward/backward is a collective and a
rank running one more than its peers would hang the group.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchrlhf.data import Batch


@dataclass(frozen=True)
class Batching:
    """How a trainable role cuts a rollout: the ``batching`` sub-section of ``actor`` and ``critic``.

    ``ppo_mini_batch_size`` counts prompts (each brings ``rollout.n`` responses) and sets the math: one
    optimizer step per mini-batch, ``ppo_epochs`` passes. Micro-batches (``ppo_micro_batch_size_per_device``
    samples, or token budgets of ``max_tokens_per_micro_batch`` with ``use_dynamic_bsz``) only trade memory
    for speed. ``log_prob_micro_batch_size_per_device`` is the no-grad passes' micro size (default: the
    training one).
    """

    ppo_mini_batch_size: int = 1
    ppo_epochs: int = 1
    ppo_micro_batch_size_per_device: int = 1
    log_prob_micro_batch_size_per_device: int | None = None
    use_dynamic_bsz: bool = False
    max_tokens_per_micro_batch: int | None = None

    @property
    def max_tokens(self) -> int | None:
        """The micro-batch token budget, when micro-batches are cut by tokens."""
        return self.max_tokens_per_micro_batch if self.use_dynamic_bsz else None

    @property
    def log_prob_micro_batch_size(self) -> int:
        return self.log_prob_micro_batch_size_per_device or self.ppo_micro_batch_size_per_device

    def validate(self, *, rollout_n: int, dp_size: int, train_batch_size: int | None = None,
                 role: str = "actor") -> None:
        """Raise ValueError, quoting the numbers, if these sizes cannot split a rollout (`validate_batch_sizes`)."""
        if self.ppo_epochs <= 0:
            raise ValueError(f"{role}.batching.ppo_epochs must be positive, got {self.ppo_epochs}")
        if rollout_n <= 0:
            raise ValueError(f"rollout.n must be positive, got {rollout_n}")
        validate_batch_sizes(
            ppo_mini_batch_size=self.ppo_mini_batch_size, rollout_n=rollout_n, dp_size=dp_size,
            ppo_micro_batch_size_per_device=self.ppo_micro_batch_size_per_device, train_batch_size=train_batch_size,
            use_dynamic_bsz=self.use_dynamic_bsz, max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
            role=f"{role}.batching",
        )


def validate_batch_sizes(
    *,
    ppo_mini_batch_size: int,
    rollout_n: int,
    dp_size: int,
    ppo_micro_batch_size_per_device: int | None = None,
    train_batch_size: int | None = None,
    use_dynamic_bsz: bool = False,
    max_tokens_per_micro_batch: int | None = None,
    max_seq_len: int | None = None,
    role: str = "actor",
) -> None:
    """Raise ValueError, quoting the numbers, if the global batch sizes cannot be split as configured.

    ``train_batch_size`` and ``ppo_mini_batch_size`` count prompts; each prompt gives
    ``rollout_n`` responses; a mini-batch's responses are split evenly over ``dp_size``
    ranks and, without dynamic batching, into micro-batches of
    ``ppo_micro_batch_size_per_device``.
    """
    for name, value in (("ppo_mini_batch_size", ppo_mini_batch_size), ("rollout_n", rollout_n), ("dp_size", dp_size)):
        if value is None or value <= 0:
            raise ValueError(f"{role}.{name} must be a positive integer, got {value}")
    if train_batch_size is not None:
        if train_batch_size <= 0:
            raise ValueError(f"data.train_batch_size must be positive, got {train_batch_size}")
        if train_batch_size % ppo_mini_batch_size:
            raise ValueError(
                f"data.train_batch_size={train_batch_size} is not divisible by "
                f"{role}.ppo_mini_batch_size={ppo_mini_batch_size} (both counted in prompts)"
            )
    mini_responses = ppo_mini_batch_size * rollout_n
    if mini_responses % dp_size:
        raise ValueError(
            f"{role}.ppo_mini_batch_size={ppo_mini_batch_size} prompts x rollout.n={rollout_n} = "
            f"{mini_responses} responses per mini-batch do not split over {dp_size} data-parallel ranks"
        )
    per_rank = mini_responses // dp_size
    if use_dynamic_bsz:
        if not max_tokens_per_micro_batch or max_tokens_per_micro_batch <= 0:
            raise ValueError(
                f"{role}.use_dynamic_bsz needs max_tokens_per_micro_batch > 0, got {max_tokens_per_micro_batch}"
            )
        if max_seq_len is not None and max_tokens_per_micro_batch < max_seq_len:
            raise ValueError(
                f"{role}.max_tokens_per_micro_batch={max_tokens_per_micro_batch} is smaller than the longest "
                f"possible sequence (prompt + response = {max_seq_len} tokens)"
            )
        return
    micro = ppo_micro_batch_size_per_device
    if micro is None or micro <= 0:
        raise ValueError(f"{role}.ppo_micro_batch_size_per_device must be a positive integer, got {micro}")
    if per_rank % micro:
        raise ValueError(
            f"{role}: {mini_responses} responses per mini-batch / {dp_size} data-parallel ranks = {per_rank} "
            f"per rank, not divisible by ppo_micro_batch_size_per_device={micro}"
        )


def balanced_partition(lengths: list[int], k: int) -> list[list[int]]:
    """Split sample indices into ``k`` groups with near-equal length sums (largest-first greedy).

    Each group keeps its indices ascending, so a group of a sorted-by-position
    batch stays in position order.
    """
    if k <= 0:
        raise ValueError(f"need at least one partition, got k={k}")
    heap = [(0, i) for i in range(k)]
    groups: list[list[int]] = [[] for _ in range(k)]
    for idx in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, g = heapq.heappop(heap)
        groups[g].append(idx)
        heapq.heappush(heap, (load + lengths[idx], g))
    return [sorted(g) for g in groups]


def token_budget_partition(lengths: list[int], max_tokens: int, min_parts: int = 1) -> list[list[int]]:
    """The fewest (at least ``min_parts``) balanced groups whose token sums all fit in ``max_tokens``."""
    too_long = [n for n in lengths if n > max_tokens]
    if too_long:
        raise ValueError(f"a sample has {max(too_long)} tokens, more than max_tokens_per_micro_batch={max_tokens}")
    k = max(min_parts, -(-sum(lengths) // max_tokens), 1)
    while True:
        groups = balanced_partition(lengths, k)
        if all(sum(lengths[i] for i in g) <= max_tokens for g in groups):
            return groups
        k += 1


def _agree_max(value: int, group: dist.ProcessGroup | None) -> int:
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def micro_batch_groups(
    lengths: list[int],
    *,
    micro_batch_size: int | None,
    max_tokens: int | None,
    group: dist.ProcessGroup | None,
) -> list[list[int]]:
    """Index groups, one per micro-batch, the same count on every rank of ``group`` (some may be empty).

    With ``max_tokens`` the groups are token-balanced; otherwise consecutive runs of
    ``micro_batch_size`` samples.
    """
    n = len(lengths)
    if max_tokens is not None:
        groups = token_budget_partition(lengths, max_tokens) if n else []
        k = _agree_max(len(groups), group)
        if k != len(groups) and n:
            groups = token_budget_partition(lengths, max_tokens, min_parts=k)
    else:
        if not micro_batch_size or micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        groups = [list(range(i, min(i + micro_batch_size, n))) for i in range(0, n, micro_batch_size)]
        k = _agree_max(len(groups), group)
    return groups + [[] for _ in range(k - len(groups))]


def strided_mini_batches(batch: Batch, num_mini_batches: int) -> list[Batch]:
    """Mini-batch j takes local samples j, j+M, j+2M, ... (M = ``num_mini_batches``).

    The runtime shards a batch over data-parallel ranks in contiguous equal blocks
    whose size divides by M, so global sample g lands in mini-batch ``g mod M`` on
    any number of ranks: the optimizer sees the same mini-batches whatever the
    data-parallel size, and results do not depend on it.
    """
    if len(batch) % num_mini_batches:
        raise ValueError(f"{len(batch)} samples do not split into {num_mini_batches} mini-batches")
    return [batch[torch.arange(j, len(batch), num_mini_batches)] for j in range(num_mini_batches)]


@dataclass
class ModelInputs:
    """A micro-batch's model inputs with the all-padding columns cut off both ends."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_len: int  # response columns kept (the rest are padding in every row)


def trimmed_inputs(batch: Batch, response_width: int) -> ModelInputs:
    """Drop leading prompt columns and trailing response columns that are padding in every row.

    Prompts are left-padded and responses right-padded, so a micro-batch of short
    samples carries columns no row attends to; cutting them saves compute without
    changing any real token's output (positions are passed explicitly).
    """
    ids, mask = batch["input_ids"], batch["attention_mask"]
    pos = batch["position_ids"] if "position_ids" in batch else (mask.long().cumsum(-1) - 1).clamp(min=0)
    total = ids.shape[1]
    prompt_width = total - response_width
    used = mask.bool().any(0).nonzero().flatten()
    first = min(int(used[0]), prompt_width - 1) if len(used) else prompt_width - 1
    last = max(int(used[-1]), prompt_width) if len(used) else prompt_width
    last = min(last, total - 1)
    sl = slice(first, last + 1)
    return ModelInputs(ids[:, sl], mask[:, sl], pos[:, sl], last + 1 - prompt_width)


def pad_response_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad ``[b, r]`` with zeros back to ``[b, width]``."""
    return torch.nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x
