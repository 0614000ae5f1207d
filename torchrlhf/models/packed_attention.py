"""Attention over packed rows and a shared prompt's cached K/V, inside the HF model's own forward.

Shared-prefix training (`workers/shared_prefix.py`) runs a group's prompt once and
its samples' responses as separate packed rows that must read the prompt's keys
and values. Rather than a second model definition, it plugs into transformers'
attention registry: every model the library loads uses the attention
implementation ``"torchrlhf_sdpa"``, which is plain SDPA (same mask, same kernel)
unless the forward is given an `AttentionPlan` through the ``attention_plan=``
keyword, which transformers passes unchanged from ``model(...)`` (or a decoder
layer's call) down to each attention call: a `PackedAttention` here, the
generation engine's KV-cache plan there (`generation/model.py`). FSDP2 and TP
hooks, activation checkpointing and HF weights stay as they are.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTN_IMPLEMENTATION = "torchrlhf_sdpa"


class PackedAttention:
    """One forward's attention plan over a packed row: its segments, and a recorded or read prompt K/V.

    ``segments`` lists ``(start, end, prefix_start, prefix_end)``: row tokens ``start:end`` form one
    sequence that attends to ``prefix`` tokens ``prefix_start:prefix_end`` and causally to itself.
    Each segment is its own SDPA call, so the cost grows with the sum of the segments' squares, not
    with the square of the packed row.

    - Prefix pass (``record=True``, empty prefix ranges): each layer's post-RoPE keys/values are kept
      so the suffix passes can attend to them.
    - Suffix pass (``prefix`` given): a segment is one sample, reading its prompt's cached K/V.

    A plain class on purpose: FSDP2's mixed-precision input cast walks dataclasses and
    containers in ``forward`` kwargs and would copy the tensors held here.
    """

    def __init__(
        self,
        segments: list[tuple[int, int, int, int]],
        *,
        record: bool = False,
        prefix: PrefixKV | None = None,
    ) -> None:
        self.segments = segments
        self.record = record
        self.prefix = prefix
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    def _mask(self, length: int, prefix_len: int, device) -> torch.Tensor:
        """[length, prefix_len + length]: every prefix column, then causal (bottom-right aligned)."""
        key = (length, prefix_len)
        if key not in self._masks:
            full = torch.ones(length, prefix_len + length, dtype=torch.bool, device=device)
            self._masks[key] = full.tril(diagonal=prefix_len)
        return self._masks[key]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D]."""
        if self.record and layer not in self.keys:  # activation checkpointing re-runs the forward: keep the first
            self.keys[layer], self.values[layer] = k, v
        rows = [(start, end) for start, end, _, _ in self.segments]
        qs_, ks_, vs_ = (_pieces(t, rows) for t in (q, k, v))
        if self.prefix is not None:
            pk, pv = self.prefix.get(layer)
            spans = [(p_start, p_end) for _, _, p_start, p_end in self.segments if p_end > p_start]
            pks, pvs = _pieces(pk, spans), _pieces(pv, spans)
        outs = []
        for start, end, p_start, p_end in self.segments:
            qs, ks, vs = qs_[start, end], ks_[start, end], vs_[start, end]
            if p_end > p_start:
                ks = torch.cat([pks[p_start, p_end], ks], dim=2)
                vs = torch.cat([pvs[p_start, p_end], vs], dim=2)
                mask = self._mask(end - start, p_end - p_start, q.device)
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True))
            else:
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return out.transpose(1, 2).contiguous()


def _pieces(x: torch.Tensor, ranges: list[tuple[int, int]]) -> dict[tuple[int, int], torch.Tensor]:
    """``x[:, :, a:b]`` for each range, cut by one `torch.split` at every range's ends.

    Why not plain slices: each slice's backward allocates a zero tensor of ``x``'s full size and
    the autograd engine adds them all up, which costs (segments x row) per layer in training.
    A split's backward is one concatenation. A range spanning several pieces is their concatenation.
    """
    bounds = sorted({0, x.shape[2], *(a for a, _ in ranges), *(b for _, b in ranges)})
    parts = torch.split(x, [b - a for a, b in zip(bounds, bounds[1:])], dim=2)
    index = {a: i for i, a in enumerate(bounds)}
    out = {}
    for a, b in ranges:
        if (a, b) not in out:
            chunk = parts[index[a] : index[b]]
            out[a, b] = chunk[0] if len(chunk) == 1 else torch.cat(chunk, dim=2)
    return out


class PrefixKV:
    """The prompts' keys/values of every layer, as leaves that collect the suffix passes' gradients.

    ``backward()`` then runs the prompts' backward once with those accumulated
    gradients, which is exactly the dense gradient: the prompt's contribution from
    every sample of its group, summed. It also sends a zero gradient into the prefix
    pass's ``output`` (the model's output): FSDP2 gathers a block's parameters for
    backward when the gradient reaches that block's output, and a gradient entering
    only through the keys/values would find them still sharded. Keys/values that no trainable
    parameter reaches (a frozen layer's, below the first LoRA adapter) take no gradient.
    """

    def __init__(self, recorded: PackedAttention, output: torch.Tensor, requires_grad: bool) -> None:
        self._output = output
        self._sources = {layer: (recorded.keys[layer], recorded.values[layer]) for layer in recorded.keys}
        self._leaves = {
            layer: (k.detach().requires_grad_(requires_grad and k.requires_grad),
                    v.detach().requires_grad_(requires_grad and v.requires_grad))
            for layer, (k, v) in self._sources.items()
        }

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._leaves[layer]

    def backward(self) -> None:
        """Backpropagate the accumulated K/V gradients through the prompts' forward (call once)."""
        outputs, grads = [self._output], [torch.zeros_like(self._output)]
        for layer, pair in self._sources.items():
            for src, leaf in zip(pair, self._leaves[layer]):
                if src.requires_grad:
                    outputs.append(src)
                    grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        if self._output.requires_grad:
            torch.autograd.backward(outputs, grads)
        self._sources, self._output = {}, None


def sliding_window(config) -> int | None:
    """The attention window of a HF config when it is in use (Mistral; Qwen2/3 with use_sliding_window), else None.

    The packed masks are plain causal: a sequence longer than the window would attend past it.
    """
    window = getattr(config, "sliding_window", None)
    uses = getattr(config, "use_sliding_window", config.model_type == "mistral")
    return window if uses and window else None


class AttentionPlan(Protocol):
    """What a forward's ``attention_plan=`` does at each layer: `PackedAttention` (training),
    `generation.model.CachedAttention` (the engine's KV cache)."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [b, H, T, D], k/v [b, Hkv, T, D] after RoPE -> the attention output [b, T, H, D]."""
        ...


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               attention_plan: AttentionPlan | None = None, **kwargs):
    if attention_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attention_plan.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
