"""Decode attention on CUDA: one query per slot over that slot's cached keys and values (flash-decoding).

Why a kernel of our own: SDPA has no kernel for one query over a long, ragged KV cache, so on CUDA it runs a
prefill kernel per slot and reads every key up to the bucket's ``kv_len`` under a mask (on an H100 that was 21 %
of a generation's kernel time). Here each program takes one (slot, KV head) pair and one split of that slot's
keys, stopping at the slot's own position; the query heads that share the KV head ride in one tile, so each
key and value is read once for all of them (GQA without repeats). When slots x KV heads are too few to fill the
GPU, the keys are split and a second small kernel merges the splits by their log-sum-exp (flash-decoding).

The kernels are Triton's; the op is opaque to ``torch.compile`` (`torch.library.custom_op`), so the compiled
decode step calls it as is and the CUDA graphs replay it. On a CPU the engine keeps SDPA, the faster there.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine attends through SDPA there
    triton = None

MAX_SPLITS = 32


def available(device: torch.device) -> bool:
    """Whether the decode kernel runs on ``device`` (CUDA with Triton)."""
    return triton is not None and device.type == "cuda"


if triton is not None:

    @triton.jit
    def _split_kernel(Q, K, V, POS, OUT, LSE, scale, split_size,
                      sq_b, sq_h, sk_b, sk_n, sk_h, sv_b, sv_n, sv_h,
                      so_b, so_h, so_s, so_g, sl_b, sl_h, sl_s,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, MERGED: tl.constexpr, PRECISION: tl.constexpr):
        """One (slot, KV head, split): softmax(q k^T) v over keys [split start, min(split end, position + 1))."""
        b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        length = tl.load(POS + b).to(tl.int32) + 1
        start = s * split_size
        end = tl.minimum(start + split_size, length)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(Q + b * sq_b + (h * GROUP + g)[:, None] * sq_h + d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                    other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < end
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + b * sk_b + n[:, None] * sk_n + h * sk_h + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(V + b * sv_b + n[:, None] * sv_n + h * sv_h + d[None, :], mask=kv_ok, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(n_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        has = total > 0
        acc = acc / tl.where(has, total, 1.0)[:, None]
        out_ok = g_ok[:, None] & d_ok[None, :]
        if MERGED:  # one split: this is the answer, in the output's dtype, [b, heads, D]
            tl.store(OUT + b * so_b + (h * GROUP + g)[:, None] * so_h + d[None, :],
                     acc.to(OUT.dtype.element_ty), mask=out_ok)
        else:
            tl.store(OUT + b * so_b + h * so_h + s * so_s + g[:, None] * so_g + d[None, :], acc, mask=out_ok)
            lse = tl.where(has, m + tl.log(tl.where(has, total, 1.0)), float("-inf"))
            tl.store(LSE + b * sl_b + h * sl_h + s * sl_s + g, lse, mask=g_ok)

    @triton.jit
    def _merge_kernel(PART, LSE, OUT, splits, sp_b, sp_h, sp_s, sp_g, sl_b, sl_h, sl_s, so_b, so_h,
                      GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """One (slot, KV head): the splits' outputs weighted by exp(their log-sum-exp), rescaled as they come.
        The first split holds key 0, which every slot attends, so its log-sum-exp is finite."""
        b, h = tl.program_id(0), tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < GROUP
        ok = g_ok[:, None] & (d < HEAD_DIM)[None, :]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for s in range(0, splits):
            lse = tl.load(LSE + b * sl_b + h * sl_h + s * sl_s + g, mask=g_ok, other=0.0)
            part = tl.load(PART + b * sp_b + h * sp_h + s * sp_s + g[:, None] * sp_g + d[None, :], mask=ok, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            total = total * alpha + w
            acc = acc * alpha[:, None] + part * w[:, None]
            m = m_new
        tl.store(OUT + b * so_b + (h * GROUP + g)[:, None] * so_h + d[None, :], (acc / total[:, None]).to(
            OUT.dtype.element_ty), mask=ok)


def num_splits(slots: int, kv_heads: int, kv_len: int, processors: int, block_n: int) -> int:
    """Splits of the keys so that about two programs run per multiprocessor, no split shorter than a block."""
    wanted = -(-2 * processors // (slots * kv_heads))
    return max(1, min(wanted, -(-kv_len // block_n), MAX_SPLITS))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kv_len: int, scale: float,
           processors: int) -> torch.Tensor:
    """q [b, H, D]; k/v one layer's cache [slots >= b, max_seq_len, Hkv, D]; positions [b] (slot i attends to its
    keys 0..positions[i]; ``kv_len`` > every position bounds the splits) -> [b, H, D] in q's dtype."""
    b, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode attention needs the head dimension contiguous in q, k and v")
    block_g, block_d = max(16, triton.next_power_of_2(group)), max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 64 else 32
    splits = num_splits(b, kv_heads, kv_len, processors, block_n)
    split_size = -(-kv_len // (splits * block_n)) * block_n
    splits = -(-kv_len // split_size)
    out = torch.empty(b, heads, head_dim, dtype=q.dtype, device=q.device)
    if splits == 1:
        part, lse = out, out  # the split kernel writes the answer; LSE unused
        part_strides, lse_strides = (out.stride(0), out.stride(1), 0, 0), (0, 0, 0)
    else:
        part = torch.empty(b, kv_heads, splits, group, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(b, kv_heads, splits, group, dtype=torch.float32, device=q.device)
        part_strides, lse_strides = part.stride()[:4], lse.stride()[:3]
    _split_kernel[(b, kv_heads, splits)](
        q, k, v, positions, part, lse, scale, split_size,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *part_strides, *lse_strides,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, MERGED=splits == 1,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    if splits > 1:
        _merge_kernel[(b, kv_heads)](
            part, lse, out, splits, *part.stride()[:4], *lse.stride()[:3], out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_G=block_g, BLOCK_D=block_d, num_warps=4)
    return out


@torch.library.custom_op("torchrlhf::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: int,
                     positions: torch.Tensor, kv_len: int, scale: float) -> torch.Tensor:
    """`launch` on layer ``layer`` of the engine's whole caches [layers, slots, max_seq_len, Hkv, D], on CUDA.

    The op takes the whole caches, not a layer's view, so that a compiled step hands it the cache it wrote in
    place (a view of a written input could be materialised as a copy)."""
    # CUDA's multiprocessors; one elsewhere (Triton's interpreter, TRITON_INTERPRET=1, runs on CPU tensors)
    processors = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
    return launch(q, k_cache[layer], v_cache[layer], positions, kv_len, scale, processors)


@decode_attention.register_fake
def _(q, k_cache, v_cache, layer, positions, kv_len, scale):
    return q.new_empty(q.shape)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The same attention, one slot at a time in fp32 (tests): q [b, H, D], k/v [slots, L, Hkv, D]."""
    b, heads, _ = q.shape
    group = heads // k.shape[2]
    out = []
    for i in range(b):
        n = int(positions[i]) + 1
        keys = k[i, :n].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, n, D]
        values = v[i, :n].float().repeat_interleave(group, dim=1).transpose(0, 1)
        weights = torch.softmax(q[i].float()[:, None] @ keys.transpose(1, 2) * scale, dim=-1)  # [H, 1, n]
        out.append((weights @ values)[:, 0])
    return torch.stack(out).to(q.dtype)


