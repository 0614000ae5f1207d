"""Reduce a [B, T] per-token loss to a scalar, exactly under gradient accumulation."""

import torch

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    *,
    normalizer: float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate ``loss_mat`` [B, T] over ``loss_mask``.

    - token-mean: sum over valid tokens / number of valid tokens.
    - seq-mean-token-sum: mean over sequences of the per-sequence token sum.
    - seq-mean-token-mean: mean over sequences of the per-sequence token mean.
    - seq-mean-token-sum-norm (Dr.GRPO): mean over sequences of token sum / ``loss_scale_factor``
      (a constant; default ``loss_mask.shape[-1]``) so that long answers are not down-weighted.

    Only sequences with at least one valid token count for the seq-mean-* modes. With ``normalizer``
    (token-mean: the global number of valid tokens of the mini-batch across micro-batches and DP ranks;
    seq-mean-*: the global number of sequences with a valid token) the result is sum / normalizer, so summing
    micro-batch losses (and all-reducing gradients with SUM) reproduces the full mini-batch loss exactly.
    """
    if loss_mat.shape != loss_mask.shape:
        raise ValueError(f"agg_loss: loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    mask = loss_mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        total = (loss_mat * mask).sum()
        denom = mask.sum().clamp(min=1) if normalizer is None else normalizer
        return total / denom
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid names: {', '.join(AGG_MODES)}")
    tokens = mask.sum(-1)
    seq_loss = (loss_mat * mask).sum(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_loss = seq_loss / tokens.clamp(min=1)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_loss = seq_loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    valid_seqs = (tokens > 0).to(loss_mat.dtype)
    denom = valid_seqs.sum().clamp(min=1) if normalizer is None else normalizer
    return (seq_loss * valid_seqs).sum() / denom
