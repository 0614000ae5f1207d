"""Masked reductions shared by the estimators and losses."""

import torch


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (x * mask).sum() if dim is None else (x * mask).sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over positions where mask is set; 0 (not NaN) when the mask is empty."""
    return masked_sum(x, mask, dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    mean = masked_mean(x, mask)
    n = mask.sum()
    var = masked_sum((x - mean) ** 2, mask) / n.clamp(min=1)
    if unbiased:
        var = var * n / (n - 1).clamp(min=1)
    return var


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) with statistics over masked positions only (unbiased variance, as verl)."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    return whitened if shift_mean else whitened + mean


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a [B, R] mask, the index of its last set position (0 for an empty row). A multi-turn
    response's loss mask has gaps (observation tokens), so this is not ``mask.sum(-1) - 1``."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), positions, -1).amax(-1).clamp(min=0)


def at_last_token(values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """A per-sequence value placed at the last response token the mask keeps, in a float32 [B, R] tensor."""
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    out[torch.arange(len(out)), last_index(response_mask).cpu()] = values.float().cpu()
    return out
