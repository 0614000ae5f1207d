"""DAPO helpers: overlong reward shaping and the dynamic-sampling group filter, and their config sections."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrlhf.algorithms.advantages import Index, group_ids


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """Soft overlong punishment [B] (float32): 0 up to max_len - buffer, then linear down to -penalty_factor at
    max_len (and, as verl, further below past it). Added to the sequence reward."""
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_penalty: overlong_buffer_len must be in (0, {max_response_length}], got {overlong_buffer_len}"
        )
    exceed = response_lengths.float() - (max_response_length - overlong_buffer_len)
    return torch.clamp(-exceed / overlong_buffer_len * penalty_factor, max=0.0)


def filter_groups(index: Index, scores: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Keep only groups whose scores differ (a group where all agree has zero group-relative advantage, so it
    contributes no gradient). Groups of one sample are dropped too. Returns (keep mask [B] bool, dropped groups)."""
    s = scores.float()
    gid = group_ids(index, len(s), s.device)
    n_groups = int(gid.max()) + 1 if gid.numel() else 0
    g_max = s.new_full((n_groups,), -torch.inf).scatter_reduce(0, gid, s, "amax")
    g_min = s.new_full((n_groups,), torch.inf).scatter_reduce(0, gid, s, "amin")
    keep_group = g_max > g_min
    return keep_group[gid], int((~keep_group).sum())


@dataclass(frozen=True)
class FilterGroups:
    """The ``algorithm.filter_groups`` section (verl's): DAPO's dynamic sampling. With ``enable``, only prompt groups
    whose rewards differ train (`filter_groups`); rollouts continue until a batch is full, and a step that has
    generated more than ``max_num_gen_batches`` batches' worth of prompts fails (the data is too easy or too hard;
    values below 1 count as 1)."""

    enable: bool = False
    max_num_gen_batches: int = 10


@dataclass(frozen=True)
class OverlongBuffer:
    """The ``algorithm.overlong_buffer`` section: DAPO's soft overlong punishment (`overlong_penalty`). A response
    longer than ``rollout.max_tokens - len`` tokens loses up to ``penalty_factor`` of reward, linearly over the last
    ``len`` tokens; ``len: 0`` turns it off."""

    len: int = 0
    penalty_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.len < 0:
            raise ValueError(f"len: must be >= 0 (0: off), got {self.len}")
        if not self.penalty_factor >= 0:
            raise ValueError(f"penalty_factor: must be >= 0, got {self.penalty_factor}")

    @property
    def enabled(self) -> bool:
        return self.len > 0

    def penalty(self, response_lengths: torch.Tensor, max_response_length: int) -> torch.Tensor:
        """`overlong_penalty` of each response [B]."""
        return overlong_penalty(response_lengths, max_response_length, overlong_buffer_len=self.len,
                                penalty_factor=self.penalty_factor)
