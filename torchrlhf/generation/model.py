"""The engine's forward: the HF model's own decoder layers, with an attention plan that keeps a KV cache.

Training and generation run one model definition. Each decoder layer (projections, q/k norms,
RoPE, SwiGLU, residuals) is the HF family's own ``forward``; the only thing the engine adds is
where keys and values live. Every model the library loads uses the attention implementation
``"torchrlhf_sdpa"`` (`models/packed_attention.py`), which hands attention to the plan given as
the forward's ``attention_plan=`` keyword: `PackedAttention` in training (shared prompts,
packed rows), `CachedAttention` here (write this step's keys/values into the engine's cache,
attend over the cached ones). What HF's model-level forward adds per step (its cache object,
mask building, output containers) is left out: this module calls the embedding, the layers,
the final norm and the head itself.

Because the projections are the HF ``nn.Linear`` modules, the same code runs tensor-parallel
after `parallelize_module` turns them into colwise/rowwise DTensor modules (projections then
return this rank's heads), and on CPU after `PrepackedLinears` gives them oneDNN-packed weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from torchrlhf.generation.decode_attention import decode_attention
from torchrlhf.models.moe import MOE_MODEL_TYPES
from torchrlhf.models.packed_attention import ATTN_IMPLEMENTATION, sdpa, sliding_window
from torchrlhf.models.parallelize import TP_SUPPORTED_MODEL_TYPES, block_tp_shard_dims

# The decoder families with the Llama block layout (what the TP plan supports too), and the mixture-of-experts
# families (their sparse blocks run as the family defines them; under TP each rank runs a share of the experts).
SUPPORTED_MODEL_TYPES = TP_SUPPORTED_MODEL_TYPES + MOE_MODEL_TYPES

# Which dim of each parameter is split across TP ranks in the generation layout
# (suffix of the HF parameter name -> dim; anything else is replicated): the training block plan's, and a
# mixture-of-experts block's stacked experts on the expert dim (`models.expert_parallel.split_experts_over_tp`).
TP_SHARD_DIMS = {**block_tp_shard_dims(), "mlp.experts.gate_up_proj": 0, "mlp.experts.down_proj": 0}


@dataclass
class ModelDims:
    """Shapes the engine needs; head counts are per TP rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def check_supported(config, max_seq_len: int) -> None:
    """Raise if the HF config is outside what the engine supports."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"NativeEngine supports model types {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}"
        )
    window = sliding_window(config)
    if window is not None and window < max_seq_len:
        raise ValueError(
            f"sliding-window attention (window {window}) is not implemented; use max_seq_len <= {window}"
        )


def rope_tables(model: nn.Module, max_seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq_len, head_dim] from the model's own rotary module, computed once.

    Its ``inv_freq`` and ``attention_scaling`` carry rope_theta and the static scaling types
    (linear, llama3, yarn) exactly as HF computes them per forward.
    """
    rotary = model.model.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if "dynamic" in rope_type or "longrope" in rope_type:
        raise ValueError(f"rope type {rope_type!r} depends on the sequence length; NativeEngine supports static RoPE only")
    inv_freq = rotary.inv_freq.to(device=device, dtype=torch.float32)
    pos = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = (inv_freq[None, :, None] @ pos[None, None, :]).transpose(1, 2)[0]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = getattr(rotary, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


class CachedAttention:
    """One engine forward's attention: store the new keys/values in cache slots, attend over the cache.

    Prefill (``positions`` None): right-padded prompts, one per slot of ``slots``, written at positions
    ``0..S-1`` and attended causally (padding writes junk that decode overwrites before it is read).
    Decode: one token per slot ``0..span-1`` at ``positions``; attention reads cache positions
    ``< kv_len`` through views, masked to each slot's own length, so nothing is gathered or copied.
    Extend (``slots`` and ``positions`` [b, T]): T appended tokens per slot of ``slots``, written after what
    the slot holds and attending to it and causally to each other: a multi-turn trajectory continues on its
    cached keys/values, only the new tokens computed. Rows are right-padded; their padding writes junk after
    the row's real tokens (at most at the scratch position ``max_seq_len - 1``), where the slot holds nothing
    yet and decode overwrites it before it is read, as prefill's padding does. So the writes take the rows'
    shape and read nothing back from the device (selecting the real tokens would wait for it).
    """

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, *, slots: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, kv_len: int = 0, kernel: bool = False) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.slots, self.positions, self.kv_len = slots, positions, kv_len
        self.kernel = kernel
        if positions is not None and positions.dim() == 1:  # decode
            b = positions.shape[0]
            self.rows = torch.arange(b, device=positions.device)
            if not kernel:  # `decode_attention` masks by the positions itself
                cols = torch.arange(kv_len, device=positions.device)
                self.mask = (cols[None, :] <= positions[:, None]).view(b, 1, 1, kv_len)
        elif positions is not None:  # extend
            b, t = positions.shape
            cols = torch.arange(kv_len, device=positions.device)
            self.mask = (cols[None, None, :] <= positions[:, :, None]).view(b, 1, t, kv_len)
            # (slot, position) of every appended token, padding included: [b, T] each
            self.write = (slots[:, None].expand(b, t), positions.clamp(max=k_cache.shape[2] - 1))

    def attend(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [b, H, T, D], k/v [b, Hkv, T, D] (HF's layout after RoPE) -> [b, T, H, D] (``module``: the HF
        attention module of layer ``module.layer_idx``)."""
        layer = module.layer_idx
        if self.positions is None:
            s = q.shape[2]
            self.k_cache[layer, self.slots, :s] = k.transpose(1, 2)
            self.v_cache[layer, self.slots, :s] = v.transpose(1, 2)
            out = sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return out.transpose(1, 2)
        if self.positions.dim() == 2:
            slots, cols = self.write
            at = (slots.new_full((1, 1), layer), slots, cols)  # one index_put on the whole cache (see below)
            self.k_cache.index_put_(at, k.transpose(1, 2))
            self.v_cache.index_put_(at, v.transpose(1, 2))
            kc = self.k_cache[layer, self.slots, : self.kv_len].transpose(1, 2)  # [b, Hkv, L, D] (gathered)
            vc = self.v_cache[layer, self.slots, : self.kv_len].transpose(1, 2)
            out = sdpa(q, kc, vc, attn_mask=self.mask, scale=scale, enable_gqa=True)
            return out.transpose(1, 2)
        b, heads, _, head_dim = q.shape
        # One index_put on the whole cache (not on a view of it): under torch.compile a write through a
        # view of an input becomes a copy of the entire cache, while this one stays in place.
        at = (self.rows.new_full((b,), layer), self.rows, self.positions)
        self.k_cache.index_put_(at, k[:, :, 0])
        self.v_cache.index_put_(at, v[:, :, 0])
        if self.kernel:
            out = decode_attention(q[:, :, 0], self.k_cache, self.v_cache, layer, self.positions, self.kv_len,
                                   scale)
            return out.view(b, 1, heads, head_dim)
        kc, vc = self.k_cache[layer, :b], self.v_cache[layer, :b]
        kv_heads = k.shape[1]
        # Group query heads by their KV head so GQA needs no repeated KV: q [b, Hkv, G, D].
        qg = q[:, :, 0].reshape(b, kv_heads, heads // kv_heads, head_dim)
        out = sdpa(
            qg, kc[:, : self.kv_len].transpose(1, 2), vc[:, : self.kv_len].transpose(1, 2),
            attn_mask=self.mask, scale=scale,
        )
        return out.reshape(b, 1, heads, head_dim)


class DecodeAndExtend:
    """The attention of one forward over a decode step and appended tokens (`CachedDecoder.decode_and_extend`):
    the sequence is ``[span decode tokens] + [rows x T appended tokens]``; each part is attended by its own plan
    (``decode``, ``extend``), the decode part's cache writes first, so an appended token overwrites the junk a
    parked slot's decode row wrote at the same position."""

    def __init__(self, decode: CachedAttention, extend: CachedAttention, span: int) -> None:
        self.decode, self.extend, self.span = decode, extend, span

    def attend(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [1, H, N, D], k/v [1, Hkv, N, D] -> [1, N, H, D]."""
        span, heads, d = self.span, q.shape[1], q.shape[-1]
        rows = self.extend.positions.shape[0]

        def split(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = t.shape[1]
            return (t[0, :, :span].transpose(0, 1)[:, :, None],  # [span, h, 1, D]
                    t[0, :, span:].reshape(h, rows, -1, d).transpose(0, 1))  # [rows, h, T, D]

        (qd, qe), (kd, ke), (vd, ve) = split(q), split(k), split(v)
        decoded = self.decode.attend(module, qd, kd, vd, scale).reshape(span, heads, d)
        extended = self.extend.attend(module, qe, ke, ve, scale).reshape(-1, heads, d)
        return torch.cat([decoded, extended])[None]


class CachedDecoder:
    """Prefill and decode of an HF causal LM through its own layers, with the engine's KV cache.

    The KV cache is two tensors ``[layers, slots, max_seq_len, kv_heads, head_dim]`` (`KVCache.k`, ``.v``);
    this class only reads and writes the slots it is given.
    """

    def __init__(self, model: nn.Module, max_seq_len: int, device, dtype, decode_kernel: bool = False) -> None:
        cfg = model.config
        check_supported(cfg, max_seq_len)
        # The layers hand attention to the plan only under this implementation; elsewhere it is plain SDPA.
        cfg._attn_implementation = ATTN_IMPLEMENTATION
        self.model = model
        self.layers = list(model.model.layers)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cos, self.sin = rope_tables(model, max_seq_len, device, dtype)
        self.decode_kernel = decode_kernel  # decode steps attend through `decode_attention` (CUDA)

    def dims(self, tp_size: int) -> ModelDims:
        cfg = self.model.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if heads % tp_size or kv_heads % tp_size:
            raise ValueError(
                f"TP size {tp_size} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads}"
            )
        return ModelDims(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads // tp_size, head_dim=self.head_dim)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, plan: CachedAttention) -> torch.Tensor:
        """tokens/positions [b, T] -> final hidden states [b, T, D] (before the final norm)."""
        x = self.model.model.embed_tokens(tokens)
        rope = (self.cos[positions], self.sin[positions])
        for layer in self.layers:
            x = layer(x, position_embeddings=rope, attention_plan=plan)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.model.model.norm(x)).float()

    def prefill(
        self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, k_cache, v_cache
    ) -> torch.Tensor:
        """Run right-padded prompts ``tokens`` [b, S] into cache ``slots`` [b].

        Returns the logits [b, V] at each prompt's last real token.
        """
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device).expand(b, s)
        x = self._forward(tokens, positions, CachedAttention(k_cache, v_cache, slots=slots))
        return self._logits(x[torch.arange(b, device=x.device), lengths - 1])

    def extend(self, tokens: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
               kv_len: int, k_cache, v_cache) -> torch.Tensor:
        """Append right-padded ``tokens`` [b, T] (``lengths`` real) to cache ``slots`` [b], after the ``starts``
        [b] positions each slot already holds; ``kv_len``: the longest slot after it, ``max(starts + lengths)``
        (the caller knows it without reading the device). Returns the logits [b, V] at each row's last real
        token."""
        b, t = tokens.shape
        positions = starts[:, None] + torch.arange(t, device=tokens.device)[None, :]
        plan = CachedAttention(k_cache, v_cache, slots=slots, positions=positions, kv_len=kv_len)
        x = self._forward(tokens, positions.clamp(max=self.cos.shape[0] - 1), plan)
        return self._logits(x[torch.arange(b, device=x.device), lengths - 1])

    def decode_and_extend(self, tokens: torch.Tensor, positions: torch.Tensor, span: int, kv_len: int,
                          ext_tokens: torch.Tensor, ext_starts: torch.Tensor, ext_lengths: torch.Tensor,
                          ext_slots: torch.Tensor, ext_kv_len: int, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` and `extend` in one forward: the projections and MLPs run once over all their tokens
        (on a CPU a small matmul costs about the same for 8 rows as for 30), attention per part. Returns the
        decode logits [span, V] and the logits at each appended row's last real token [rows, V]."""
        rows, t = ext_tokens.shape
        ext_positions = ext_starts[:, None] + torch.arange(t, device=tokens.device)[None, :]
        plan = DecodeAndExtend(
            CachedAttention(k_cache, v_cache, positions=positions, kv_len=kv_len, kernel=self.decode_kernel),
            CachedAttention(k_cache, v_cache, slots=ext_slots, positions=ext_positions, kv_len=ext_kv_len),
            span)
        flat_tokens = torch.cat([tokens, ext_tokens.reshape(-1)])[None]
        flat_positions = torch.cat([positions, ext_positions.reshape(-1).clamp(max=self.cos.shape[0] - 1)])[None]
        x = self._forward(flat_tokens, flat_positions, plan)[0]
        appended = x[span:].view(rows, t, -1)[torch.arange(rows, device=x.device), ext_lengths - 1]
        return self._logits(x[:span]), self._logits(appended)

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, span: int, kv_len: int, k_cache, v_cache
    ) -> torch.Tensor:
        """One step for slots 0..span-1: token [span] goes to ``positions`` [span].

        Attention reads only cache positions < ``kv_len`` (the longest live sequence + 1). Returns
        logits [span, V].
        """
        plan = CachedAttention(k_cache, v_cache, positions=positions, kv_len=kv_len, kernel=self.decode_kernel)
        x = self._forward(tokens[:, None], positions[:, None], plan)
        return self._logits(x[:, 0])
