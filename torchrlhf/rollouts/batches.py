"""Batches of generations of different prompt widths, and Batches as plain checkpointable state."""

from __future__ import annotations

from typing import Any

import torch

from torchrlhf.data import Batch

PROMPT_COLUMNS = ("prompts", "input_ids", "attention_mask", "position_ids")  # left-padded prompt width


def _prompt_width(batch: Batch) -> int:
    """Left-padded prompt width: the "prompts" column of a generation, or "input_ids" of a prompt batch."""
    return batch["prompts" if "prompts" in batch else "input_ids"].shape[1]


def left_pad_prompts(gen: Batch, width: int, pad_id: int) -> Batch:
    """``gen`` (a generation or a prompt batch) with its prompt part left-padded to ``width`` tokens, so
    batches of other widths concatenate."""
    extra = width - _prompt_width(gen)
    if extra < 0:
        raise ValueError(f"cannot pad prompts of width {_prompt_width(gen)} to {width}")
    if extra == 0:
        return gen
    out = gen.copy()
    out.tensors = dict(gen.tensors)
    for key in PROMPT_COLUMNS:
        if key in gen:
            t = gen[key]
            fill = pad_id if key in ("prompts", "input_ids") else 0
            out.tensors[key] = torch.cat([t.new_full((len(t), extra), fill), t], dim=1)
    return out


def concat_generations(parts: list[Batch], pad_id: int) -> Batch:
    """Generations (or prompt batches) of different prompt widths as one Batch."""
    width = max(_prompt_width(p) for p in parts)
    return Batch.concat([left_pad_prompts(p, width, pad_id) for p in parts])


def concat_prompts(prompts: list[Batch], pad_id: int) -> Batch:
    """Prompt Batches (possibly of different left-padded widths) as one, without their seeds: a prompt
    that is generated again gets a fresh one."""
    return concat_generations([p.select(*[k for k in p.keys() if k != "seed"]) for p in prompts], pad_id)


def split_even(batch: Batch, parts: int) -> list[Batch]:
    """Consecutive shards as equal as possible (the first ones one larger), in order."""
    size, extra = divmod(len(batch), parts)
    out, start = [], 0
    for d in range(parts):
        end = start + size + (d < extra)
        out.append(batch[start:end])
        start = end
    return out


def batch_state(batch: Batch) -> dict[str, Any]:
    """A Batch as plain containers (`torch.load(weights_only=True)` reads it back)."""
    return {"tensors": dict(batch.tensors), "non_tensors": {k: list(v) for k, v in batch.non_tensors.items()},
            "meta": dict(batch.meta)}


def batch_from_state(state: dict[str, Any]) -> Batch:
    return Batch(state["tensors"], state["non_tensors"], state["meta"])
