"""A compact decoder forward over a Hugging Face model's own modules.

The engine does not use the HF forward (its cache, masks and per-step bookkeeping
dominate decode time); it calls the HF projection/norm weights of the supported
families directly (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norms) and
keeps its own KV cache. Because it calls the HF ``nn.Linear`` modules, the same
code runs tensor-parallel after `parallelize_module` turns them into DTensor
colwise/rowwise modules: projections then return this rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from torchrlhf.generation.prepacked import PrepackedLinears
from torchrlhf.models.packed_attention import sliding_window
from torchrlhf.models.parallelize import TP_SUPPORTED_MODEL_TYPES, block_tp_shard_dims

# The decoder families with the Llama block layout: what the TP plan and this forward both implement.
SUPPORTED_MODEL_TYPES = TP_SUPPORTED_MODEL_TYPES

# Which dim of each parameter is split across TP ranks in the generation layout
# (suffix of the HF parameter name -> dim; anything else is replicated): the training block plan's.
TP_SHARD_DIMS = block_tp_shard_dims()


@dataclass
class ModelDims:
    """Shapes the engine needs; head counts are per TP rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int


def check_supported(config, max_seq_len: int) -> None:
    """Raise if the HF config is outside what the compact forward implements."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"NativeEngine supports model types {SUPPORTED_MODEL_TYPES}, got {config.model_type!r}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"NativeEngine supports hidden_act='silu' (SwiGLU), got {act!r}")
    window = sliding_window(config)
    if window is not None and window < max_seq_len:
        raise ValueError(
            f"sliding-window attention (window {window}) is not implemented; use max_seq_len <= {window}"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm exactly (fp32 statistics, weight applied in the input dtype)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rope_tables(model: nn.Module, max_seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_seq_len, head_dim] from the model's own rotary module.

    Using its ``inv_freq`` and ``attention_scaling`` picks up rope_theta and the
    static scaling types (linear, llama3, yarn) exactly as HF computes them.
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, H, D]; cos/sin broadcastable to [..., T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class CompactDecoder:
    """Prefill and decode over an HF causal LM's modules with an external KV cache.

    The KV cache is two tensors ``[layers, slots, max_seq_len, kv_heads, head_dim]``
    owned by the engine; this class only reads and writes the slots it is given.
    """

    def __init__(self, model: nn.Module, max_seq_len: int, device, dtype) -> None:
        self.model = model
        cfg = model.config
        check_supported(cfg, max_seq_len)
        self.layers = list(model.model.layers)
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.model_type == "qwen3"
        self.cos, self.sin = rope_tables(model, max_seq_len, device, dtype)
        self.prepacked: PrepackedLinears | None = None  # set by the engine on CPU fp32

    def _linear(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x) if self.prepacked is None else self.prepacked(module, x)

    def dims(self, tp_size: int) -> ModelDims:
        cfg = self.model.config
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        if heads % tp_size or kv_heads % tp_size:
            raise ValueError(
                f"TP size {tp_size} must divide num_attention_heads={heads} and num_key_value_heads={kv_heads}"
            )
        return ModelDims(num_layers=cfg.num_hidden_layers, num_kv_heads=kv_heads // tp_size, head_dim=self.head_dim)

    def _qkv(self, layer: nn.Module, h: torch.Tensor, positions: torch.Tensor):
        """Projections + q/k norm + RoPE; h [B, T, D] -> q [B,T,H,hd], k/v [B,T,Hkv,hd]."""
        attn = layer.self_attn
        b, t, _ = h.shape
        q = self._linear(attn.q_proj, h).view(b, t, -1, self.head_dim)
        k = self._linear(attn.k_proj, h).view(b, t, -1, self.head_dim)
        v = self._linear(attn.v_proj, h).view(b, t, -1, self.head_dim)
        if self.qk_norm:
            q = rms_norm(q, attn.q_norm.weight, attn.q_norm.variance_epsilon)
            k = rms_norm(k, attn.k_norm.weight, attn.k_norm.variance_epsilon)
        cos = self.cos[positions][..., None, :]
        sin = self.sin[positions][..., None, :]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _mlp(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, layer.post_attention_layernorm.weight, self.eps)
        mlp = layer.mlp
        gate, up = self._linear(mlp.gate_proj, h), self._linear(mlp.up_proj, h)
        return x + self._linear(mlp.down_proj, F.silu(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        x = rms_norm(x, self.model.model.norm.weight, self.eps)
        return self._linear(self.model.lm_head, x).float()

    def prefill(
        self, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, k_cache, v_cache
    ) -> torch.Tensor:
        """Run right-padded prompts ``tokens`` [b, S] into cache ``slots`` [b].

        Every slot's positions 0..S-1 are written; those past a prompt's length hold
        junk that decode overwrites before it is ever attended to. Returns the
        logits [b, V] at each prompt's last real token.
        """
        b, s = tokens.shape
        positions = torch.arange(s, device=tokens.device)
        x = self.model.model.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_layernorm.weight, self.eps)
            q, k, v = self._qkv(layer, h, positions)
            k_cache[i, slots, :s] = k
            v_cache[i, slots, :s] = v
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            x = x + self._linear(layer.self_attn.o_proj, o.transpose(1, 2).reshape(b, s, -1))
            x = self._mlp(layer, x)
        last = x[torch.arange(b, device=x.device), lengths - 1]
        return self._logits(last)

    def decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, span: int, kv_len: int, k_cache, v_cache
    ) -> torch.Tensor:
        """One step for slots 0..span-1: token [span] goes to ``positions`` [span].

        Attention reads only cache positions < ``kv_len`` (the longest live
        sequence + 1), through views, so nothing is gathered or copied. Returns
        logits [span, V].
        """
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        mask = (torch.arange(kv_len, device=tokens.device)[None, :] <= positions[:, None]).view(b, 1, 1, kv_len)
        x = self.model.model.embed_tokens(tokens[:, None])
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_layernorm.weight, self.eps)
            q, k, v = self._qkv(layer, h, positions[:, None])
            kc, vc = k_cache[i, :span], v_cache[i, :span]
            kc[rows, positions] = k[:, 0]
            vc[rows, positions] = v[:, 0]
            kv_heads = k.shape[2]
            # Group query heads by their KV head so GQA needs no repeated KV: q [b, Hkv, G, hd].
            qg = q[:, 0].reshape(b, kv_heads, -1, self.head_dim)
            o = F.scaled_dot_product_attention(
                qg, kc[:, :kv_len].transpose(1, 2), vc[:, :kv_len].transpose(1, 2), attn_mask=mask
            )
            x = x + self._linear(layer.self_attn.o_proj, o.reshape(b, 1, -1))
            x = self._mlp(layer, x)
        return self._logits(x[:, 0])
