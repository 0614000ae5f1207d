"""Token log-probs and entropy from logits without materialising extra [B, T, V] tensors.

Both work over ``chunk_size`` positions at a time (batch and sequence flattened) and take the sampling
``temperature`` inside, so a caller never makes a scaled or float32 copy of the logits: the only
vocabulary-sized tensor kept for backward is the logits themselves, and the peak extra memory is one
[chunk_size, V] float32 block.
"""

import torch


def _chunks(n: int, chunk_size: int) -> list[slice]:
    return [slice(s, s + chunk_size) for s in range(0, n, chunk_size)]


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z if temperature == 1.0 else z / temperature


def _log_softmax(logits: torch.Tensor, lse: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) from the saved logsumexp, as one fresh float32 tensor: (logits - T lse) / T."""
    out = torch.sub(logits.float(), lse[:, None], alpha=temperature)
    return out if temperature == 1.0 else out.div_(temperature)


class _ChunkedLogProb(torch.autograd.Function):
    """log p(label) with p = softmax(logits / T): z[label] - logsumexp(z), chunk by chunk in float32.

    Saves the logits and the [N] logsumexp; backward recomputes the softmax one chunk at a time.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk_size: int) -> torch.Tensor:
        out = torch.empty(labels.shape, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for c in _chunks(len(logits), chunk_size):
            z = _scaled(logits[c], temperature)
            lse[c] = torch.logsumexp(z, dim=-1)
            out[c] = z.gather(-1, labels[c, None]).squeeze(-1)
        out -= lse
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, labels, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for c in _chunks(len(logits), ctx.chunk_size):
            g = _log_softmax(logits[c], lse[c], ctx.temperature).exp_().neg_()  # d/dz of -logsumexp
            g.scatter_add_(-1, labels[c, None], torch.ones_like(lse[c, None]))
            grad[c] = g.mul_(grad_out[c, None] / ctx.temperature)
        return grad, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    """H = logsumexp(z) - sum(softmax(z) * z) with z = logits / T, chunk by chunk in float32.

    dH/dz = -p * (log p + H); backward recomputes p one chunk at a time from the saved logsumexp.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float, chunk_size: int) -> torch.Tensor:
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(out)
        for c in _chunks(len(logits), chunk_size):
            z = _scaled(logits[c], temperature)
            lse[c] = torch.logsumexp(z, dim=-1)
            out[c] = lse[c] - torch.linalg.vecdot(torch.sub(z, lse[c, None]).exp_(), z)
        ctx.save_for_backward(logits, lse, out)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for c in _chunks(len(logits), ctx.chunk_size):
            log_p = _log_softmax(logits[c], lse[c], ctx.temperature)
            g = log_p.exp().mul_(log_p.add_(entropy[c, None]))
            grad[c] = g.mul_(grad_out[c, None] / -ctx.temperature)
        return grad, None, None


def _check(name: str, temperature: float, chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"{name}: chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"{name}: temperature must be > 0, got {temperature}")


def log_probs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> torch.Tensor:
    """log softmax(logits / temperature)[labels] for logits [..., V] and labels [...], as float32 [...]."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"log_probs_from_logits: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}"
        )
    _check("log_probs_from_logits", temperature, chunk_size)
    flat = _ChunkedLogProb.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).long(),
                                 float(temperature), chunk_size)
    return flat.view(labels.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dim, as float32 [...]."""
    _check("entropy_from_logits", temperature, chunk_size)
    flat = _ChunkedEntropy.apply(logits.reshape(-1, logits.shape[-1]), float(temperature), chunk_size)
    return flat.view(logits.shape[:-1])
