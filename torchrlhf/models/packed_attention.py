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
from torch._subclasses.fake_tensor import unset_fake_temporarily
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

ATTN_IMPLEMENTATION = "torchrlhf_sdpa"


def attends_in_fp32(q: torch.Tensor) -> bool:
    """Whether attention on ``q`` is computed in fp32: bf16/fp16 on a CPU, where ATen's attention kernels are
    1.4-5x slower than in fp32 at the shapes RL trains and generates (`tools/bench/bench_attention.py`), and
    fp32 is the more accurate."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention`, in fp32 where `attends_in_fp32`, output in the inputs' dtype.

    Every attention the library runs (training, dense or packed, and the engine) computes this way, so they agree.
    """
    if attends_in_fp32(q):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


class PackedAttention:
    """One forward's attention plan over a packed row: its segments, and a recorded or read prompt K/V.

    ``segments`` lists ``(start, end, prefix_start, prefix_end)``, in row order and covering the row:
    row tokens ``start:end`` form one sequence that attends to ``prefix`` tokens ``prefix_start:prefix_end``
    and causally to itself. All segments go through one SDPA call per layer: each becomes a row of a
    padded batch ``[segments, heads, longest segment, longest prefix + longest segment]`` under a
    block mask (`PackedLayout`), so the cost grows with segments x longest segment x its keys, not with
    the square of the packed row, and a layer costs one kernel call, not one per sample.

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
        self._layout: PackedLayout | None = None  # the same for every layer: built at the first

    @torch.compiler.disable
    def attend(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [1, H, T, D], k/v [1, Hkv, T, D] -> [1, T, H, D].

        Eager under ``torch.compile`` (compiled blocks break the graph here, and the layer index is read
        here, not in compiled code, so all blocks share one graph): the plan records per-layer keys and
        builds its layout from Python lists."""
        layer = module.layer_idx
        if self.record and layer not in self.keys:  # activation checkpointing re-runs the forward: keep the first
            self.keys[layer], self.values[layer] = k, v
        if self.prefix is not None:
            pk, pv = self.prefix.get(layer)
            k, v = torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)  # the row's keys after the prompts'
        if self._layout is None:
            # index data made from Python lists: real tensors even under the dry run's FakeTensorMode
            with unset_fake_temporarily():
                self._layout = PackedLayout(self.segments, k.shape[2] - q.shape[2], q.device)
        lay = self._layout
        heads, dim = q.shape[1], q.shape[3]
        qs = q[0].index_select(1, lay.query_index).view(heads, lay.num, lay.q_len, dim).transpose(0, 1)
        ks, vs = (x[0].index_select(1, lay.key_index).view(x.shape[1], lay.num, lay.k_len, dim).transpose(0, 1)
                  for x in (k, v))
        out = sdpa(qs, ks, vs, attn_mask=lay.mask, scale=scale, enable_gqa=True)
        # [S, H, Lq, D] -> the row's tokens in order, [1, T, H, D]
        return out.transpose(1, 2).reshape(lay.num * lay.q_len, heads, dim).index_select(0, lay.row_index)[None]


class PackedLayout:
    """Where a packed row's segments sit in the padded batch of `PackedAttention`'s one SDPA call.

    Segment i's queries are batch row i, positions ``0:L_i`` (``Lq`` = the longest ``L``); its keys are its
    prompt's ``Q_i`` cached keys at ``0:Q_i`` and its own at ``Qmax:Qmax + L_i``. Indices point into the
    keys ``[prompts' cached keys (P), the row's own (T)]``. A padding query repeats its segment's last
    token and mask row (never a row with no key, whose softmax would be NaN); its output is dropped, so
    its gradient is exactly zero. Padding keys point at index 0 and are masked out.
    """

    def __init__(self, segments: list[tuple[int, int, int, int]], prefix_tokens: int, device) -> None:
        ends = [0] + [end for _, end, _, _ in segments[:-1]]
        if [start for start, *_ in segments] != ends:
            raise ValueError(f"packed segments must cover the row in order: {segments}")
        lens = torch.tensor([end - start for start, end, _, _ in segments])
        prompt = torch.tensor([p_end - p_start for _, _, p_start, p_end in segments])
        starts = torch.tensor([start for start, *_ in segments])
        p_starts = torch.tensor([p_start for _, _, p_start, _ in segments])
        self.num, self.q_len, q_max = len(segments), int(lens.max()), int(prompt.max())
        self.k_len = q_max + self.q_len
        j = torch.arange(self.q_len).clamp(max=(lens - 1)[:, None])  # [S, Lq] query position, padding repeats
        self.query_index = (starts[:, None] + j).flatten().to(device)
        c = torch.arange(self.k_len)
        is_prompt, own = c < q_max, c - q_max  # [K]: prompt columns, then own columns
        key_valid = torch.where(is_prompt, c < prompt[:, None], own < lens[:, None])  # [S, K]
        key = torch.where(is_prompt, p_starts[:, None] + c, prefix_tokens + starts[:, None] + own)
        self.key_index = torch.where(key_valid, key, 0).flatten().to(device)
        causal = is_prompt | (own[None, None, :] <= j[:, :, None])  # [S, Lq, K]
        self.mask = (key_valid[:, None, :] & causal)[:, None].to(device)  # [S, 1, Lq, K]
        valid = torch.arange(self.q_len) < lens[:, None]
        self.row_index = (torch.arange(self.num * self.q_len).view(self.num, self.q_len))[valid].to(device)


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
        self._requires_grad = requires_grad
        self._sources = {layer: (recorded.keys[layer], recorded.values[layer]) for layer in recorded.keys}
        self._leaves = {
            layer: (k.detach().requires_grad_(requires_grad and k.requires_grad),
                    v.detach().requires_grad_(requires_grad and v.requires_grad))
            for layer, (k, v) in self._sources.items()
        }
        self._held: list[tuple[torch.Tensor, torch.Tensor]] = []  # other prefix-pass tensors (`hold`)
        self.routing = None  # a mixture-of-experts model's prefix routing (`models.moe.RoutingRecord`), held
        self.offloaded_bytes = 0  # what the prompt pass saved for backward in host memory (`prefix_forward`)

    def get(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._leaves[layer]

    def hold(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Leaves standing for more of the prefix pass's tensors (a MoE model's router logits, which the
        suffix passes' load-balancing loss reads), whose gradients `backward` sends on with the K/V's."""
        leaves = [t.detach().requires_grad_(self._requires_grad and t.requires_grad) for t in tensors]
        self._held += list(zip(tensors, leaves))
        return leaves

    def backward(self) -> None:
        """Backpropagate the accumulated K/V gradients through the prompts' forward (call once)."""
        outputs, grads = [self._output], [torch.zeros_like(self._output)]
        pairs = [pair for layer, srcs in self._sources.items() for pair in zip(srcs, self._leaves[layer])]
        for src, leaf in pairs + self._held:
            if src.requires_grad:
                outputs.append(src)
                grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(leaf))
        if self._output.requires_grad:
            torch.autograd.backward(outputs, grads)
        self._sources, self._output, self._held = {}, None, []


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

    def attend(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [b, H, T, D], k/v [b, Hkv, T, D] after RoPE -> the attention output [b, T, H, D] (``module``: the
        HF attention module; its ``layer_idx`` says which layer)."""
        ...


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
               attention_plan: AttentionPlan | None = None, **kwargs):
    if attention_plan is None:
        if attends_in_fp32(query):
            out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                                  dropout=dropout, scaling=scaling, **kwargs)
            return out.to(query.dtype), weights
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return attention_plan.attend(module, query, key, value, scaling), None


AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
