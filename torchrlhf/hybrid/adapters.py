"""The rollout side of an adapter-only weight sync: merge LoRA factors into the frozen base, load the result.

A LoRA actor on ranks of its own sends only its adapter factors (`ActorWorker.weight_manifest`), bytes in
proportion to the rank. The rollout engine started from the same base model, and the base never
changes, so each sync's factors are merged here, module by module, into the base weight read back from
the model's safetensors (memory-mapped: no second copy of the base is held), and the merged weights go
through the engine's ordinary `update_weights`. Every sync merges from the base, never from the previous
merge, so nothing accumulates; modules without adapters are never touched.

`AdapterMerger` stands in for the engine wherever the weight stream is received: the direct sync
(`hybrid.broadcast.receive_weights`) and the asynchronous relay (`hybrid.relay.WeightRelay`, which then
keeps versions of the factors only).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from torchrlhf.models.lora import adapter_shard_dims, is_adapter, merge_stream
from torchrlhf.models.sharded import SafetensorsReader


class AdapterMerger:
    """An engine stand-in whose `update_weights` takes LoRA factors (``<m>.lora_A``, then ``<m>.lora_B``, as
    the actor streams them) and loads ``<m>.weight = W_base + scaling · B @ A`` into ``engine``.

    Args:
        engine: the rollout engine (its TP layout decides the shards; see `adapter_shard_dims`).
        model_path: the HF directory the engine was built from (the actor's base model).
        scaling: the adapters' ``alpha / rank``.
    """

    def __init__(self, engine: Any, model_path: str | Path, scaling: float) -> None:
        self.engine, self.scaling = engine, scaling
        self.tp_size, self.tp_mesh = engine.tp_size, engine.tp_mesh
        self._weight_dims = engine.param_shard_dims()
        self._dims = adapter_shard_dims(self._weight_dims)
        self._base = SafetensorsReader(model_path)
        self._groups: list[set[str]] = engine.load_groups()

    def param_shard_dims(self) -> dict[str, int | None]:
        """TP dims of every adapter factor the engine's weights could take."""
        return self._dims

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(self._merged(named_tensors))

    def _merged(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        scalings: dict[str, float] = {}  # the weights merged so far

        def with_base() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                if not is_adapter(name):
                    raise ValueError(f"AdapterMerger.update_weights: {name!r} is not a LoRA factor")
                yield name, tensor
                if name.endswith(".lora_B"):
                    weight = f"{name[: -len('.lora_B')]}.weight"
                    scalings[weight] = self.scaling
                    yield weight, self._base_shard(weight)

        yield from merge_stream(with_base(), scalings)
        # An engine that loads some weights only together (vLLM's fused qkv / gate_up modules) gets the
        # untouched members of those groups from the base as well.
        for group in self._groups:
            if group & scalings.keys():
                for name in sorted(group - scalings.keys()):
                    yield name, self._base_shard(name)

    def _base_shard(self, name: str) -> torch.Tensor:
        """This rank's generation-layout shard of base weight ``name``."""
        if name not in self._base:
            raise KeyError(f"AdapterMerger: the base model has no weight {name!r} to merge an adapter into")
        full = self._base.get(name)
        dim = self._weight_dims.get(name)
        if dim is None or self.tp_size == 1:
            return full
        return torch.chunk(full, self.tp_size, dim=dim)[self.tp_mesh.get_local_rank()]

