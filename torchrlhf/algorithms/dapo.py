"""DAPO helpers: overlong reward shaping and the dynamic-sampling group filter."""

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
