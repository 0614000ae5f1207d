"""oneDNN-prepacked projection weights for CPU fp32 generation.

On CPU, ``F.linear`` calls MKL sgemm, which re-packs the weight on every call;
a decode step calls every projection on a handful of rows, so that repacking is
a large share of the step. oneDNN's linear with the weight reordered once into
its blocked layout does the same product 1.2-2x faster at 1-64 rows (measured
by ``tools/bench/bench_generate.py``). A packed copy is only correct while its
weight is unchanged, so it is used for weights one owner writes through one
door: the engine's own weights, written by ``update_weights``, which
`PrepackedLinears.invalidate` s the copy of every weight it writes.
"""

from __future__ import annotations

import torch
from torch import nn


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 on any x86/ARM CPU build; bf16 packing needs AVX512-BF16-class CPUs, so fp32 only."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


class PrepackedLinears:
    """Packed copies of some ``nn.Linear`` weights, and the linear that uses them.

    Args:
        linears: the modules to pack (plain, non-DTensor ``nn.Linear`` on CPU, fp32).
        free_plain: modules whose plain weight storage is freed once packed (weights the
            engine owns and nothing else reads). Whoever writes such a weight gives it
            its storage back first; the next `refresh` packs and frees it again.
    """

    def __init__(self, linears: list[nn.Linear], free_plain: list[nn.Linear] = ()) -> None:
        self.linears = list(linears)
        self.free_plain = set(free_plain)
        self._packed: dict[nn.Linear, torch.Tensor] = {}
        self._readers: dict[int, list[nn.Linear]] = {}  # id(weight) -> the modules that read it (tied weights: several)
        for module in self.linears:
            self._readers.setdefault(id(module.weight), []).append(module)

    @torch.no_grad()
    def refresh(self) -> int:
        """Pack every module that has no packed copy; returns how many were packed."""
        packed = 0
        for module in self.linears:
            if module in self._packed:
                continue
            self._packed[module] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            if module in self.free_plain:
                module.weight.untyped_storage().resize_(0)
            packed += 1
        return packed

    def invalidate(self, weight: torch.Tensor) -> None:
        """Drop the packed copy of every module whose weight is ``weight`` (it was just written)."""
        for module in self._readers.get(id(weight), ()):
            self._packed.pop(module, None)

    def clear(self) -> None:
        """Drop the packed copies (``release``); the next `refresh` packs everything again."""
        self._packed.clear()

    def __call__(self, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        packed = self._packed.get(module)
        if packed is None:
            return module(x)
        return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")
