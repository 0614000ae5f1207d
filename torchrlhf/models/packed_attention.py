"""Attention over packed rows and a shared prompt's cached K/V, inside the HF model's own forward.

Shared-prefix training (`workers/shared_prefix.py`) runs a group's prompt once and
its samples' responses as separate packed rows that must read the prompt's keys
and values. Rather than a second model definition, it plugs into transformers'
attention registry: every model loaded for training uses the attention
implementation ``"torchrlhf_sdpa"``, which is plain SDPA (same mask, same kernel)
unless the forward is given a `PackedAttention` through the ``packed=`` keyword,
which transformers passes unchanged from ``model(...)`` down to each attention
call. FSDP2 and TP hooks, activation checkpointing and HF weights stay as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTN_IMPLEMENTATION = "torchrlhf_sdpa"


class PackedAttention:
    """One forward's attention plan: a boolean mask and, optionally, a recorded or read prompt K/V.

    - Prefix pass (``record=True``): each layer's post-RoPE keys/values are kept so the
      suffix passes can attend to them; the mask is block-causal over the packed prompts.
    - Suffix pass (``prefix`` given): each layer attends to ``prefix`` keys/values at
      ``prefix_index`` followed by its own; the mask has ``len(prefix_index) + T`` columns.

    A plain class on purpose: FSDP2's mixed-precision input cast walks dataclasses and
    containers in ``forward`` kwargs and would copy the tensors held here.
    """

    def __init__(
        self,
        mask: torch.Tensor,
        *,
        record: bool = False,
        prefix: PrefixKV | None = None,
        prefix_index: torch.Tensor | None = None,
    ) -> None:
        self.mask = mask  # [Tq, Tk] bool, True = attend
        self.record = record
        self.prefix = prefix
        self.prefix_index = prefix_index
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D]."""
        if self.record and layer not in self.keys:  # activation checkpointing re-runs the forward: keep the first
            self.keys[layer], self.values[layer] = k, v
        if self.prefix is not None:
            pk, pv = self.prefix.get(layer)
            k = torch.cat([pk.index_select(2, self.prefix_index), k], dim=2)
            v = torch.cat([pv.index_select(2, self.prefix_index), v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous()


class PrefixKV:
    """The prompts' keys/values of every layer, as leaves that collect the suffix passes' gradients.

    ``backward()`` then runs the prompts' backward once with those accumulated
    gradients, which is exactly the dense gradient: the prompt's contribution from
    every sample of its group, summed. It also sends a zero gradient into the prefix
    pass's ``output`` (the model's output): FSDP2 gathers a block's parameters for
    backward when the gradient reaches that block's output, and a gradient entering
    only through the keys/values would find them still sharded.
    """

    def __init__(self, recorded: PackedAttention, output: torch.Tensor, requires_grad: bool) -> None:
        self._output = output
        self._sources = [(recorded.keys[i], recorded.values[i]) for i in sorted(recorded.keys)]
        self._leaves = [
            (k.detach().requires_grad_(requires_grad), v.detach().requires_grad_(requires_grad))
            for k, v in self._sources
        ]
        self._layer_ids = sorted(recorded.keys)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._leaves[self._layer_ids.index(layer)]

    def backward(self) -> None:
        """Backpropagate the accumulated K/V gradients through the prompts' forward (call once)."""
        outputs, grads = [self._output], [torch.zeros_like(self._output)]
        for (k, v), (lk, lv) in zip(self._sources, self._leaves):
            for src, leaf in ((k, lk), (v, lv)):
                outputs.append(src)
                grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        torch.autograd.backward(outputs, grads)
        self._sources, self._output = [], None


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               packed: PackedAttention | None = None, **kwargs):
    if packed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return packed.attend(module.layer_idx, query, key, value, scaling), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
