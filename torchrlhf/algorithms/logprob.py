"""Token log-probs and entropy from hidden states: the vocabulary projection fused with the log-softmax.

The actor needs ``log softmax(h W^T / T)[label]`` (and the entropy of that distribution) at response
positions only. Materialising the logits costs an ``[N, V]`` tensor kept for backward plus its gradient;
here the projection runs ``chunk_size`` rows at a time, in float32 after the matmul, and only the hidden
states, the weight and three numbers per row are kept. Backward recomputes each chunk's logits: one more
matmul, which on CPU costs less than writing and re-reading the ``[N, V]`` tensors it replaces
(`tools/bench/bench_logprob.py`).

With tensor parallelism the weight is split by vocabulary rows: each rank passes its rows, the first
row's vocabulary index and the TP process group; maxima and sums over the vocabulary are all-reduced,
so no rank ever holds full-vocabulary logits (Megatron's vocab-parallel cross-entropy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Positions projected at a time: each chunk's float32 temporaries are a few [CHUNK_SIZE, V] tensors.
CHUNK_SIZE = 256


def _chunks(n: int, chunk_size: int) -> list[slice]:
    return [slice(s, s + chunk_size) for s in range(0, n, chunk_size)]


def _local_labels(labels: torch.Tensor, vocab_start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each label's row in this rank's weight, clamped into range; whether this rank owns that label)."""
    local = labels - vocab_start
    owned = (local >= 0) & (local < local_vocab)
    return local.clamp(0, local_vocab - 1), owned


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _FusedLogProb(torch.autograd.Function):
    """Forward: per chunk, z = (h W^T) / T in float32; lse, z[label] and sum softmax(z) * z over the
    vocabulary (all-reduced across ``group``). Saves h, W, labels, lse and the entropy.

    Backward: with p = softmax(z), log p = z - lse, upstream grads a (log-prob) and b (entropy),
    dL/dz = a (onehot - p) - b p (log p + H); then dL/dh = dL/dz W / T (all-reduced) and dL/dW = (dL/dz)^T h / T.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, group, vocab_start):
        ctx.set_materialize_grads(False)
        n, local_vocab = len(hidden), weight.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, entropy = torch.empty_like(log_probs), torch.empty_like(log_probs)
        local, owned = _local_labels(labels, vocab_start, local_vocab)
        for c in _chunks(n, chunk_size):
            z = (hidden[c] @ weight.t()).float()
            if temperature != 1.0:
                z.div_(temperature)
            m = _all_reduce(z.amax(-1), group, dist.ReduceOp.MAX)
            e = z.sub_(m[:, None]).exp()  # z is now z - m; e = exp(z - m)
            target = torch.where(owned[c], z.gather(-1, local[c, None]).squeeze(-1), 0.0)
            sums = torch.stack([e.sum(-1), torch.linalg.vecdot(e, z), target])  # one all-reduce for the three
            s, ez, target = _all_reduce(sums, group)
            lse[c] = m + s.log()
            log_probs[c] = target - s.log()  # (z[label] - m) - log sum exp(z - m)
            entropy[c] = s.log() - ez / s  # log sum e - E_p[z - m]
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.group, ctx.vocab_start = temperature, chunk_size, group, vocab_start
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        temperature, local_vocab = ctx.temperature, weight.shape[0]
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = None  # float32; the first chunk's product creates it
        local, owned = _local_labels(labels, ctx.vocab_start, local_vocab)
        for c in _chunks(len(hidden), ctx.chunk_size):
            z = (hidden[c] @ weight.t()).float()
            log_p = torch.sub(z, lse[c, None], alpha=temperature).div_(temperature) if temperature != 1.0 \
                else z.sub_(lse[c, None])
            a = grad_log_probs[c] if grad_log_probs is not None else torch.zeros_like(lse[c])
            if grad_entropy is not None:  # -p (a + b (log p + H))
                coeff = log_p.add(entropy[c, None]).mul_(grad_entropy[c, None]).add_(a[:, None])
                g = log_p.exp_().mul_(coeff).neg_()
            else:
                g = log_p.exp_().mul_(-a[:, None])
            rows = owned[c].nonzero().squeeze(-1)
            g[rows, local[c][rows]] += a[rows]
            if temperature != 1.0:
                g.div_(temperature)
            g = g.to(weight.dtype)
            if grad_hidden is not None:
                torch.mm(g, weight, out=grad_hidden[c])
            if not ctx.needs_input_grad[1]:
                continue
            if grad_weight is None:
                grad_weight = (g.t() @ hidden[c]).float()
            elif weight.dtype == torch.float32:
                grad_weight.addmm_(g.t(), hidden[c])
            else:
                grad_weight += g.t() @ hidden[c]
        if grad_hidden is not None:
            _all_reduce(grad_hidden, ctx.group)  # each rank holds its vocabulary rows' share
        if ctx.needs_input_grad[1]:
            grad_weight = torch.zeros_like(weight) if grad_weight is None else grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int = CHUNK_SIZE,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(hidden @ weight^T / T)[labels], its entropy), both float32 with ``labels``' shape.

    ``hidden`` [..., D], ``weight`` [V, D] (this rank's vocabulary rows ``vocab_start:vocab_start + V``
    when ``group`` is a tensor-parallel group; every rank passes the same ``hidden`` and ``labels``),
    ``labels`` [...]. Gradients flow to ``hidden`` and ``weight``; an unused entropy costs no backward work.
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"log_probs_from_hidden: hidden {tuple(hidden.shape)} do not match labels "
                         f"{tuple(labels.shape)}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"log_probs_from_hidden: hidden size {hidden.shape[-1]} != weight {tuple(weight.shape)}")
    if chunk_size < 1:
        raise ValueError(f"log_probs_from_hidden: chunk_size must be >= 1, got {chunk_size}")
    if not temperature > 0:
        raise ValueError(f"log_probs_from_hidden: temperature must be > 0, got {temperature}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    log_probs, entropy = _FusedLogProb.apply(flat, weight, labels.reshape(-1).long(), float(temperature),
                                             chunk_size, group, vocab_start)
    return log_probs.view(labels.shape), entropy.view(labels.shape)
