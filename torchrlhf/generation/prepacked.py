"""oneDNN-prepacked projection weights for CPU generation (fp32, and bf16 where the CPU has bf16 instructions).

On CPU, ``F.linear`` calls MKL sgemm, which re-packs the weight on every call;
a decode step calls every projection on a handful of rows, so that repacking is
a large share of the step. oneDNN's linear with the weight reordered once into
its blocked layout does the same product 1.2-2x faster at 1-64 rows (measured
by ``tools/bench/bench_generate.py``). A packed copy is only correct while its
weight is unchanged, so it is used for weights one owner writes through one
door: the engine's own weights, written by ``update_weights``, which
`PrepackedLinears.invalidate` s the copy of every weight it writes.

Under ``torch.compile`` a packed linear is the opaque op ``torchrlhf::packed_linear``: the compiled
decode step fuses the norms, RoPE, SwiGLU and residual adds around oneDNN's products instead of
replacing them with unpacked GEMMs. The op finds its module by a key, so the compiled graph holds no
packed tensor and a repack (after `update_weights`) needs no recompilation.
"""

from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F
from torch import nn

_MODULES: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _packed_linear(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return _MODULES[key].eager_forward(x)


# ``PackedLinear`` ``key``'s product, opaque to ``torch.compile`` (it reads the module's packed weight as it is
# when called). Defined through ``torch.library.Library``, not ``custom_op``: its Python wrapper cost 17 us
# per call, the call itself 2-3 (210 calls per SmolLM2 decode step).
_LIB = torch.library.Library("torchrlhf", "DEF")
_LIB.define("packed_linear(Tensor x, int key, int out_features) -> Tensor")
_LIB.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("torchrlhf::packed_linear")
def _(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packs fp32 on any x86/ARM CPU build, and bf16 where the CPU has bf16 instructions
    (AVX512-BF16 or AMX: 1.25-1.46x over ``F.linear`` at decode shapes on an AMD EPYC with AVX512-BF16)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` over the same weight and bias Parameters that computes through a packed copy of
    the weight while it has one (`PrepackedLinears` gives and takes it), and like ``nn.Linear`` otherwise.

    Being the module the model calls, it needs no change to the model's forward; its parameters keep
    their names and identities, so state dicts and weight updates see the model unchanged.
    """

    packed: torch.Tensor | None = None

    @classmethod
    def wrap(cls, linear: nn.Linear) -> PackedLinear:
        out = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        out.weight, out.bias = linear.weight, linear.bias
        out.key = next(_KEYS)
        _MODULES[out.key] = out
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.torchrlhf.packed_linear(x, self.key, self.out_features)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class PrepackedLinears:
    """Turns every ``nn.Linear`` of ``model`` into a `PackedLinear` and keeps their packed copies current.

    Args:
        model: modules on CPU in fp32, not DTensor-parallel; changed in place.
        free_plain: whether a packed module's plain weight storage is freed (weights the engine owns
            and nothing else reads: a weight that is also read elsewhere, like an embedding tied to
            the head, keeps it). Whoever writes a freed weight gives it its storage back first; the
            next `refresh` packs and frees it again.
    """

    def __init__(self, model: nn.Module, free_plain: bool = False) -> None:
        self.modules: list[PackedLinear] = []
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    packed = PackedLinear.wrap(child)
                    setattr(parent, name, packed)
                    self.modules.append(packed)
        # A weight a non-linear module also reads (an embedding tied to the head) keeps its plain storage.
        read_elsewhere = {id(p) for m in model.modules() if not isinstance(m, nn.Linear)
                          for p in m.parameters(recurse=False)}
        self.free_plain = {m for m in self.modules if free_plain and id(m.weight) not in read_elsewhere}
        self._readers: dict[int, list[PackedLinear]] = {}  # id(weight) -> the modules reading it (tied: several)
        for module in self.modules:
            self._readers.setdefault(id(module.weight), []).append(module)

    @torch.no_grad()
    def refresh(self) -> int:
        """Pack every module that has no packed copy; returns how many were packed."""
        packed = 0
        for module in self.modules:
            if module.packed is not None:
                continue
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            if module in self.free_plain:
                module.weight.untyped_storage().resize_(0)
            packed += 1
        return packed

    def invalidate(self, weight: torch.Tensor) -> None:
        """Drop the packed copy of every module whose weight is ``weight`` (it was just written)."""
        for module in self._readers.get(id(weight), ()):
            module.packed = None

    def clear(self) -> None:
        """Drop the packed copies (``release``); the next `refresh` packs everything again."""
        for module in self.modules:
            module.packed = None
