"""Token log-probs and entropy from hidden states: the vocabulary projection fused with the log-softmax.

The actor needs ``log softmax(h W^T / T)[label]`` (and the entropy of that distribution) at response
positions only. Materialising the logits costs an ``[N, V]`` tensor kept for backward plus its gradient;
here the projection runs in tiles of ``chunk_size`` positions x ``vocab_chunk_size`` vocabulary rows, in
float32 after the matmul, folded into running sums as in online softmax (flash attention's trick), and
only the hidden states, the weight and three numbers per position are kept. Backward recomputes each
tile's logits: one more matmul, which on CPU costs less than writing and re-reading the ``[N, V]``
tensors it replaces. Tiles small enough to stay in cache make the elementwise passes (max, exp, sums,
the gradient) cheap (`tools/bench/bench_logprob.py`).

With tensor parallelism the weight is split by vocabulary rows: each rank passes its rows, the first
row's vocabulary index and the TP process group; maxima and sums over the vocabulary are all-reduced,
so no rank ever holds full-vocabulary logits (Megatron's vocab-parallel cross-entropy).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

# Tile sizes (positions x vocabulary rows) by device type. On a CPU each tile's float32 temporaries are
# [256, 4096] (4 MiB), small enough to stay in cache across the several elementwise passes over them; a
# [256, V] chunk (48 MiB for SmolLM2) is not: forward + backward took 1.2x as long at hidden size 576 and
# 2.3x at 64 (`tools/bench/bench_logprob.py`, sides ``rows`` and ``tiles``). On a GPU the cache argument
# does not hold and every tile costs ~10 kernel launches: an H100 profile of a 1.07 B update at CPU tiles
# showed 1536 tiles per update, with the GPU idle most of the time, so GPU tiles are [2048, 16384]
# (128 MiB of float32).
TILE_SIZES = {"cpu": (256, 4096)}
GPU_TILE_SIZES = (2048, 16384)


def tile_sizes(device: torch.device) -> tuple[int, int]:
    """(positions, vocabulary rows) of the head's tiles on ``device``."""
    return TILE_SIZES.get(device.type, GPU_TILE_SIZES)


def _chunks(n: int, chunk_size: int, fake: bool = False) -> list[slice]:
    """Slices of ``chunk_size`` over ``n``. ``fake``: the tensors are fake (a memory trace, `trainer.memory`):
    nothing is computed and, the outputs being allocated whole before the loop, every tile after the first
    allocates as the second does, so the first two and the last (perhaps shorter) stand for all, the same peak
    in a few tiles instead of hundreds (a 0.5 B model's 256 × 768 response tokens: 960 GPU tiles per pass)."""
    chunks = [slice(s, s + chunk_size) for s in range(0, n, chunk_size)]
    return chunks[:2] + chunks[-1:] if fake and len(chunks) > 3 else chunks


def _tile_labels(labels: torch.Tensor, start: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each label falls in vocabulary columns ``start:start + width``, its column in the tile,
    clamped into the tile where it does not). Masks, not indices: no device-to-host sync per tile."""
    in_tile = (labels >= start) & (labels < start + width)
    return in_tile, (labels - start).clamp_(0, width - 1)


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


def _rescaled(m: torch.Tensor, m_new: torch.Tensor, s: torch.Tensor, u: torch.Tensor, target: torch.Tensor):
    """A running fold (s = sum exp(z - m), u = sum exp(z - m) (z - m), target = z[label] - m) against a
    max ``m_new`` >= ``m``: exp(z - m_new) = exp(z - m) exp(m - m_new), and z - m_new = (z - m) + (m - m_new)."""
    shift = m - m_new
    scale = shift.exp()
    return scale * s, scale * (u + shift * s), target + shift


def _fold_tile(product: torch.Tensor, temperature: float, state: tuple | None, labels: torch.Tensor,
               start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward tile: the logits ``product`` / T (the tile's matmul, vocabulary columns ``start:``) folded
    into the running ``state`` (m, s, u, target), None at a chunk's first tile. Returns the new state."""
    z = product.float()  # in place from here: the product is this tile's own (a copy under torch.compile)
    if temperature != 1.0:
        z.div_(temperature)
    m_tile = z.amax(-1)
    if state is not None:
        m_tile = torch.maximum(state[0], m_tile)
    e = z.sub_(m_tile[:, None]).exp()  # z is now z - m_tile
    s_tile, u_tile = e.sum(-1), torch.linalg.vecdot(e, z)
    if state is None:
        target = torch.zeros_like(s_tile)  # z[label] - m, on the rank that owns the label
    else:  # the running sums, against the new max
        s, u, target = _rescaled(state[0], m_tile, *state[1:])
        s_tile, u_tile = s_tile + s, u_tile + u
    in_tile, cols = _tile_labels(labels, start, z.shape[1])
    target = torch.where(in_tile, z.gather(1, cols[:, None]).squeeze(1), target)
    return m_tile, s_tile, u_tile, target


def _grad_tile(product: torch.Tensor, temperature: float, lse: torch.Tensor, entropy: torch.Tensor,
               grad_entropy: torch.Tensor | None, grad_log_probs: torch.Tensor, labels: torch.Tensor, start: int,
               dtype: torch.dtype) -> torch.Tensor:
    """One backward tile: dL/dz / T in ``dtype`` from the recomputed logits ``product`` / T (vocabulary columns
    ``start:``), with p = softmax(z), log p = z - lse: dL/dz = a (onehot - p) - b p (log p + H)."""
    log_p = product.float()  # in place from here, as in `_fold_tile`
    if temperature != 1.0:
        log_p.div_(temperature)
    log_p.sub_(lse[:, None])
    if grad_entropy is not None:  # -p (a + b (log p + H))
        coeff = log_p.add(entropy[:, None]).mul_(grad_entropy[:, None]).add_(grad_log_probs[:, None])
        g = log_p.exp_().mul_(coeff).neg_()
    else:
        g = log_p.exp_().mul_(grad_log_probs.neg()[:, None])
    in_tile, cols = _tile_labels(labels, start, g.shape[1])
    g.scatter_add_(1, cols[:, None], torch.where(in_tile, grad_log_probs, 0.0)[:, None])
    if temperature != 1.0:
        g.div_(temperature)
    return g.to(dtype)


@functools.cache
def _compiled_tiles() -> tuple:
    """`_fold_tile` and `_grad_tile` through ``torch.compile``: each tile's elementwise passes (cast, max,
    exp, sums, the gradient) fuse into a few kernels, where eager runs about ten passes over the tile (on a
    CPU 0.34 against 0.96 ms forward and 0.50 against 1.67 ms backward per [256, 4096] tile; on a GPU it
    also saves kernel launches per tile, not measured there). Dynamic shapes: the last chunk of positions
    changes with every batch."""
    return torch.compile(_fold_tile, dynamic=True), torch.compile(_grad_tile, dynamic=True)


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, with ``out`` float32 (in place, without a temporary, when a and b are float32 too)."""
    if a.dtype == torch.float32:
        out.addmm_(a, b)
    else:
        out += (a @ b).float()


class _FusedLogProb(torch.autograd.Function):
    """Forward: per tile of ``chunk_size`` positions x ``vocab_chunk_size`` vocabulary rows, z = (h W^T) / T
    in float32, folded into a running max m, s = sum exp(z - m) and u = sum exp(z - m) (z - m) (the online
    softmax); then across ``group``. lse = m + log s and the entropy log s - u / s. Saves h, W, labels, lse
    and the entropy.

    Backward: with p = softmax(z), log p = z - lse, upstream grads a (log-prob) and b (entropy),
    dL/dz = a (onehot - p) - b p (log p + H), tile by tile; dL/dh = dL/dz W / T (all-reduced) and
    dL/dW = (dL/dz)^T h / T.

    The tiles' elementwise work is `_fold_tile` / `_grad_tile`, compiled when ``compile`` is set.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, vocab_chunk_size, group, vocab_start, compile):
        ctx.set_materialize_grads(False)
        fold = _compiled_tiles()[0] if compile else _fold_tile
        n, local_vocab = len(hidden), weight.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse, entropy = torch.empty_like(log_probs), torch.empty_like(log_probs)
        local, fake = labels - vocab_start, is_fake(hidden)
        for c in _chunks(n, chunk_size, fake):
            state = None
            for v in _chunks(local_vocab, vocab_chunk_size, fake):
                state = fold(hidden[c] @ weight[v].t(), temperature, state, local[c], v.start)
            m, s, u, target = state
            if group is not None:  # the same fold across the ranks' vocabulary shards
                m_all = _all_reduce(m.clone(), group, dist.ReduceOp.MAX)
                s, u, target = _rescaled(m, m_all, s, u, target)
                owned = (local[c] >= 0) & (local[c] < local_vocab)
                sums = torch.stack([s, u, torch.where(owned, target, 0.0)])
                m, (s, u, target) = m_all, _all_reduce(sums, group)
            log_s = s.log()
            lse[c] = m + log_s
            log_probs[c] = target - log_s
            entropy[c] = log_s - u / s
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.group, ctx.vocab_start = temperature, group, vocab_start
        ctx.chunk_size, ctx.vocab_chunk_size, ctx.compile = chunk_size, vocab_chunk_size, compile
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        grad = _compiled_tiles()[1] if ctx.compile else _grad_tile
        temperature, local_vocab = ctx.temperature, weight.shape[0]
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        a_all = grad_log_probs if grad_log_probs is not None else torch.zeros_like(lse)
        local, fake = labels - ctx.vocab_start, is_fake(hidden)
        for c in _chunks(len(hidden), ctx.chunk_size, fake):
            b = grad_entropy[c] if grad_entropy is not None else None
            for v in _chunks(local_vocab, ctx.vocab_chunk_size, fake):
                g = grad(hidden[c] @ weight[v].t(), temperature, lse[c], entropy[c], b, a_all[c], local[c],
                         v.start, weight.dtype)
                if want_hidden:
                    _accumulate(grad_hidden[c], g, weight[v])
                if want_weight:
                    _accumulate(grad_weight[v], g.t(), hidden[c])
        if want_hidden:
            grad_hidden = _all_reduce(grad_hidden, ctx.group).to(hidden.dtype)  # each rank holds its rows' share
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def log_probs_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
    compile: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log softmax(hidden @ weight^T / T)[labels], its entropy), both float32 with ``labels``' shape.

    ``hidden`` [..., D], ``weight`` [V, D] (this rank's vocabulary rows ``vocab_start:vocab_start + V``
    when ``group`` is a tensor-parallel group; every rank passes the same ``hidden`` and ``labels``),
    ``labels`` [...]. Gradients flow to ``hidden`` and ``weight``; an unused entropy costs no backward work.
    Tiles default to `tile_sizes` of the device. ``compile``: the tiles' elementwise work runs compiled
    (`_compiled_tiles`).
    """
    default_chunk, default_vocab_chunk = tile_sizes(hidden.device)
    chunk_size = default_chunk if chunk_size is None else chunk_size
    vocab_chunk_size = default_vocab_chunk if vocab_chunk_size is None else vocab_chunk_size
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(f"log_probs_from_hidden: hidden {tuple(hidden.shape)} do not match labels "
                         f"{tuple(labels.shape)}")
    if hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(f"log_probs_from_hidden: hidden size {hidden.shape[-1]} != weight {tuple(weight.shape)}")
    if chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(f"log_probs_from_hidden: chunk_size and vocab_chunk_size must be >= 1, got "
                         f"{chunk_size} and {vocab_chunk_size}")
    if not temperature > 0:
        raise ValueError(f"log_probs_from_hidden: temperature must be > 0, got {temperature}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    log_probs, entropy = _FusedLogProb.apply(flat, weight, labels.reshape(-1).long(), float(temperature),
                                             chunk_size, vocab_chunk_size, group, vocab_start, compile)
    return log_probs.view(labels.shape), entropy.view(labels.shape)
