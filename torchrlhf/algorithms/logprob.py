"""Token log-probs and entropy from logits without materialising extra [B, T, V] tensors."""

import torch


class _ChunkedLogProb(torch.autograd.Function):
    """log p(label) = logit[label] - logsumexp(logits), computed chunk by chunk in float32.

    Only the logits (already alive) and the [N] logsumexp are saved; backward recomputes the softmax one chunk
    at a time, so no [N, V] log-softmax is kept for autograd.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, chunk_size: int) -> torch.Tensor:
        out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for s in range(0, logits.shape[0], chunk_size):
            chunk = logits[s : s + chunk_size].float()
            lse[s : s + chunk_size] = torch.logsumexp(chunk, dim=-1)
            out[s : s + chunk_size] = chunk.gather(-1, labels[s : s + chunk_size, None]).squeeze(-1)
        out -= lse
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], ctx.chunk_size):
            e = s + ctx.chunk_size
            g = -torch.exp(logits[s:e].float() - lse[s:e, None])  # d/dlogits of -logsumexp
            g.scatter_add_(-1, labels[s:e, None], torch.ones_like(lse[s:e, None]))
            grad[s:e] = g * grad_out[s:e, None]
        return grad, None, None


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """log softmax(logits)[labels] for logits [..., V] and labels [...], returned as float32 [...].

    Works over ``chunk_size`` positions at a time (batch and sequence flattened), so the peak extra memory is
    one [chunk_size, V] float32 block rather than a [B, T, V] log-softmax."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"log_probs_from_logits: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"log_probs_from_logits: chunk_size must be >= 1, got {chunk_size}")
    flat = _ChunkedLogProb.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(), chunk_size)
    return flat.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum(softmax(z) * z), in float32; softmax is formed once, from the logsumexp."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    return lse.squeeze(-1) - (torch.exp(logits - lse) * logits).sum(-1)
