"""Prompt batches of different widths, even shards, and Batches as plain checkpointable state."""

from __future__ import annotations

from typing import Any

from torchrlhf.data import Batch
from torchrlhf.generation.base import concat_generations

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
