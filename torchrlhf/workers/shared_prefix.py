"""Shared-prefix, padding-free, response-only training forwards.

The n samples of a GRPO/RLOO group share one prompt. A dense forward computes that
prompt n times and the vocabulary projection at every position. Here, for a batch
(or PPO mini-batch) on one rank:

1. **Prefix pass, once.** Every distinct prompt except its last token is packed into
   one row (no padding; each prompt attends causally to itself) and run once; each
   layer's keys and values are kept (`PrefixKV`).
2. **Suffix passes, per micro-batch.** Each sample becomes ``[last prompt token] +
   its response`` and several samples are packed into one row; each token attends
   to its own prompt's cached K/V and causally to its own suffix. The LM head scores
   only the positions whose next token is a response token (`models.lm_head`).
3. **Prefix backward, once.** The suffix backward passes accumulate gradients into the
   cached K/V; one backward through the prefix pass then adds the prompts' share.

Gradients equal the dense computation up to float rounding, whichever way the
group is split over micro-batches or data-parallel ranks (the schedule of "Schedule-
Level Shared-Prefix Reuse for LLM RL Training"). Samples with equal prompts share
the prefix whether or not they come from one group: the prefix depends only on
the tokens. The prompt's last token is recomputed per sample (one token) so that
the prefix pass needs no logits and a suffix row holds every position it predicts from.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from torchrlhf.data import Batch
from torchrlhf.models.moe import RoutingRecord, record_routing
from torchrlhf.models.packed_attention import PackedAttention, PrefixKV
from torchrlhf.utils.activation_offload import saved_tensors_on
from torchrlhf.utils.flops import causal_keys


@dataclass
class PackedRow:
    """Model inputs of one packed suffix row and where its response log-probs go."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    attention: PackedAttention
    keep: torch.Tensor  # [N] row positions whose next token is a response token
    labels: torch.Tensor  # [N] those response tokens
    sample: torch.Tensor  # [N] micro-batch row of each kept position
    column: torch.Tensor  # [N] response column of each kept position


class SharedPrefixPlan:
    """Which samples of ``batch`` share a prompt, and the packed inputs of the prefix and suffix passes.

    ``batch`` has left-padded prompts and right-padded responses: ``input_ids`` /
    ``attention_mask`` [B, P + R] (optionally ``position_ids``) and ``responses`` [B, R].
    """

    def __init__(self, batch: Batch, window: int | None = None) -> None:
        ids, mask = batch["input_ids"].cpu(), batch["attention_mask"].cpu().bool()
        pos = batch["position_ids"].cpu() if "position_ids" in batch else (mask.long().cumsum(-1) - 1).clamp(min=0)
        longest = int(mask.sum(-1).max()) if len(mask) else 0
        if window is not None and longest > window:
            raise ValueError(
                f"a sample has {longest} tokens, more than the model's sliding attention window ({window}); "
                "shared-prefix training implements full causal attention only: set shared_prefix: false"
            )
        width = batch["responses"].shape[1]
        p = ids.shape[1] - width
        groups: dict[tuple[int, ...], int] = {}
        self.group_of: list[int] = []
        self.response_len: list[int] = mask[:, p:].sum(-1).tolist()
        self.responses = batch["responses"].cpu()
        prefix_ids, prefix_pos, last_id, last_pos = [], [], [], []
        for i in range(len(ids)):
            valid = mask[i, :p]
            toks, tpos = ids[i, :p][valid], pos[i, :p][valid]
            if len(toks) == 0:
                raise ValueError(f"sample {i} has an empty prompt; shared-prefix training needs at least one token")
            key = tuple(toks.tolist())
            if key not in groups:
                groups[key] = len(groups)
                prefix_ids.append(toks[:-1])
                prefix_pos.append(tpos[:-1])
                last_id.append(int(toks[-1]))
                last_pos.append(int(tpos[-1]))
            self.group_of.append(groups[key])
        self.num_groups = len(groups)
        self.last_id, self.last_pos = last_id, last_pos
        lengths = [len(t) for t in prefix_ids]
        self.prefix_start = torch.tensor([0] + lengths[:-1]).cumsum(0).tolist()
        self.prefix_len = lengths
        self.prefix_ids = torch.cat(prefix_ids)
        self.prefix_pos = torch.cat(prefix_pos)

    # ------------------------------------------------------------------ tokens computed (for benchmarks)
    def prefix_tokens(self) -> int:
        return int(self.prefix_ids.numel())

    def suffix_lengths(self) -> list[int]:
        """Tokens each sample's suffix row costs (last prompt token + response): what token budgets count."""
        return [1 + n for n in self.response_len]

    def suffix_tokens(self) -> int:
        return sum(self.suffix_lengths())

    # ------------------------------------------------------------------ prefix pass
    def prefix_inputs(self, device) -> tuple[torch.Tensor, torch.Tensor, PackedAttention]:
        """The packed prompts (minus their last tokens), one causal segment each, and a recording attention."""
        ids, pos = self.prefix_ids, self.prefix_pos
        segments = [(s, s + n, 0, 0) for s, n in zip(self.prefix_start, self.prefix_len) if n > 0]
        if not segments:  # every prompt is one token: run one unattended token so every rank still runs a forward
            ids, pos, segments = torch.tensor([self.last_id[0]]), torch.tensor([0]), [(0, 1, 0, 0)]
        return ids[None].to(device), pos[None].to(device), PackedAttention(segments, record=True)

    def prefix_token_weights(self, rows: list[int]) -> torch.Tensor:
        """Per token of the prefix pass's row, how many of samples ``rows`` repeat it (their prompt's tokens
        but the last; 0 for other prompts' and for the stand-in token of a batch of one-token prompts): the
        logical prefix-token count, for sums the dense layout takes over every sample's own copy."""
        weights = torch.zeros(max(self.prefix_tokens(), 1))
        for r in rows:
            g = self.group_of[r]
            weights[self.prefix_start[g]: self.prefix_start[g] + self.prefix_len[g]] += 1
        return weights

    # ------------------------------------------------------------------ suffix passes
    def suffix_row(self, rows: list[int], prefix: PrefixKV, device) -> PackedRow:
        """Samples ``rows`` (indices into the planned batch) packed into one row, each reading its prompt's K/V."""
        ids, pos, segments, keep, labels, sample, column = [], [], [], [], [], [], []
        offset = 0
        for j, r in enumerate(rows):
            g, n = self.group_of[r], self.response_len[r]
            resp = self.responses[r, :n]
            ids.append(torch.cat([torch.tensor([self.last_id[g]]), resp]))
            pos.append(self.last_pos[g] + torch.arange(n + 1))
            segments.append((offset, offset + n + 1, self.prefix_start[g], self.prefix_start[g] + self.prefix_len[g]))
            keep.append(offset + torch.arange(n))
            labels.append(resp)
            sample.append(torch.full((n,), j))
            column.append(torch.arange(n))
            offset += n + 1
        return PackedRow(
            input_ids=torch.cat(ids)[None].to(device),
            position_ids=torch.cat(pos)[None].to(device),
            attention=PackedAttention(segments, prefix=prefix),
            keep=torch.cat(keep).to(device),
            labels=torch.cat(labels).to(device),
            sample=torch.cat(sample).to(device),
            column=torch.cat(column).to(device),
        )


def prefix_forward(model: torch.nn.Module, plan: SharedPrefixPlan, device,
                   offload_to: torch.device | str | None = None, offload_limit: int | None = None) -> PrefixKV:
    """Run every distinct prompt of ``plan`` once through ``model`` and keep its keys/values.

    ``model`` is a causal LM or a `ValueModel`: anything whose forward takes ``position_ids``,
    ``logits_to_keep`` (positions to project) and ``packed``. The K/V carry a graph when grad is enabled.
    ``offload_to``: keep what the pass saves for its backward there (host memory) until that backward
    (`utils.activation_offload`), at most ``offload_limit`` bytes; the K/V stay on ``device``.
    """
    input_ids, position_ids, attention = plan.prefix_inputs(device)
    none = torch.zeros(0, dtype=torch.long, device=device)
    offload = nullcontext()
    if offload_to is not None and torch.is_grad_enabled():
        offload = saved_tensors_on(offload_to, limit_bytes=offload_limit, what="memory.offload_prefix_activations")
    # a mixture-of-experts model's routing: the prompts' share of the aux loss
    with offload as moved, record_routing(model) as routing:
        out = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=none, attention_plan=attention)
    prefix = PrefixKV(attention, getattr(out, "logits", out), requires_grad=torch.is_grad_enabled())
    prefix.offloaded_bytes = moved.bytes if moved is not None else 0
    if routing.logits:
        prefix.routing = RoutingRecord(prefix.hold(routing.logits), routing.experts)
    return prefix


def run_prefixes(model: torch.nn.Module, batch: Batch, window: int | None, device,
                 offload_to: torch.device | str | None = None, offload_limit: int | None = None
                 ) -> tuple[SharedPrefixPlan, PrefixKV, list[int]]:
    """Plan ``batch`` and run its prompts once: (plan, their K/V, each sample's suffix tokens for token budgets)."""
    plan = SharedPrefixPlan(batch, window)
    return plan, prefix_forward(model, plan, device, offload_to, offload_limit), plan.suffix_lengths()


def suffix_forward(model: torch.nn.Module, row: PackedRow) -> torch.Tensor:
    """``model``'s output at the row's kept positions, ``[N, ...]`` (logits for an LM, scalars for a value model)."""
    out = model(input_ids=row.input_ids, position_ids=row.position_ids, logits_to_keep=row.keep,
                attention_plan=row.attention)
    return getattr(out, "logits", out)[0]


def forward_counts(batch: Batch, plan: SharedPrefixPlan | None) -> tuple[int, int, int]:
    """(tokens, keys, scored positions) of one forward over ``batch``, padding excluded (`utils.flops`):
    with ``plan`` in the shared-prefix layout, else dense (`layout_counts`)."""
    if plan is None:
        mask = batch["attention_mask"]
        split = mask.shape[1] - batch["responses"].shape[1]
        return layout_counts(mask[:, :split].sum(-1).tolist(), mask[:, split:].sum(-1).tolist(), None)
    return layout_counts([q + 1 for q in plan.prefix_len], plan.response_len, plan.group_of)


def layout_counts(prompt_lens: list[int], response_lens: list[int], group_of: list[int] | None
                  ) -> tuple[int, int, int]:
    """(tokens, keys, scored positions) of one forward over samples of ``response_lens`` tokens.

    Dense (``group_of`` None; ``prompt_lens`` per sample): every sample's prompt and response, causal.
    Shared prompts (sample i answers prompt ``group_of[i]`` of ``prompt_lens``): each prompt but its last
    token once, causal; then per sample its last prompt token and response, reading its prompt's keys too.
    Either way the head scores the positions that predict a response token.
    """
    scored = sum(response_lens)
    if group_of is None:
        lengths = [p + r for p, r in zip(prompt_lens, response_lens)]
        return sum(lengths), sum(causal_keys(n) for n in lengths), scored
    prefix = [p - 1 for p in prompt_lens]
    tokens = sum(prefix) + sum(1 + r for r in response_lens)
    keys = sum(causal_keys(q) for q in prefix)
    keys += sum(causal_keys(1 + r, prefix[g]) for g, r in zip(group_of, response_lens))
    return tokens, keys, scored


def scatter_responses(values: torch.Tensor, row: PackedRow, num_samples: int, width: int) -> torch.Tensor:
    """Per-kept-position ``values`` [N] -> zero-padded ``[num_samples, width]`` (differentiable)."""
    out = values.new_zeros(num_samples, width)
    return out.index_put((row.sample, row.column), values)
