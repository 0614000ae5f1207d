"""Mixed precision on one rank without FSDP2: float32 master weights, compute in a lower dtype.

On a one-rank group FSDP2's mixed precision still pays for its collectives on every micro-batch: each
forward (and each backward, after resharding) casts every weight into an all-gather buffer and copies it
out, and each backward copies every gradient through a reduce-scatter buffer and casts it before it
reaches the float32 gradient. A trainable model here keeps its float32 parameters (what the optimizer
steps, checkpoints save and the rollout engine receives) and a compute copy of each in ``dtype``, cast
once per optimizer step or no-grad pass instead of once per micro-batch. Inside
`ComputeCopies.active` the model's modules hold the copies; as soon as backward has accumulated a copy's
gradient it is added into its master's float32 ``.grad`` and dropped. These are FSDP2's
``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`` numerics on one rank, without its
buffers. The copies cost ``dtype``'s bytes per parameter for as long as the model lives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class ComputeCopies:
    """Compute copies in ``dtype`` of ``model``'s float32 parameters (tied parameters share one copy)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        if dtype.itemsize >= 4:
            raise ValueError(f"ComputeCopies: compute dtype {dtype} is not below float32")
        self.dtype = dtype
        # Every (module, name) slot of a parameter: a tied weight has two slots and one master.
        self._slots = [(m, n, p) for m in model.modules() for n, p in m._parameters.items() if p is not None]
        self._masters = list({id(p): p for _, _, p in self._slots}.values())
        self._copies: dict[int, nn.Parameter] = {}

    def _cast(self) -> None:
        """Cast the masters into the copies. Every `active` starts with it: whatever wrote the float32
        weights since (an optimizer step, a checkpoint load, a user), the copies cannot be stale; it costs
        one cast per optimizer step or no-grad pass, where FSDP2 casts per micro-batch."""
        with torch.no_grad():
            if not self._copies:
                for p in self._masters:
                    copy = nn.Parameter(p.detach().to(self.dtype), requires_grad=p.requires_grad)
                    if p.requires_grad:
                        copy.register_post_accumulate_grad_hook(_into_master(p))
                    self._copies[id(p)] = copy
            else:
                torch._foreach_copy_([self._copies[id(p)] for p in self._masters], self._masters)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The model computes with the copies for the body (forward and backward both inside it)."""
        self._cast()
        for module, name, p in self._slots:
            module._parameters[name] = self._copies[id(p)]
        try:
            yield
        finally:
            for module, name, p in self._slots:
                module._parameters[name] = p

    def nbytes(self) -> int:
        """Bytes the copies hold (0 before the first `active`)."""
        return sum(c.nbytes for c in self._copies.values())


def _into_master(master: nn.Parameter):
    """The hook that moves a copy's accumulated gradient into ``master.grad`` (float32), as FSDP2's reduction does."""

    def hook(copy: torch.Tensor) -> None:
        if master.grad is None:
            master.grad = copy.grad.to(torch.float32)
        else:
            master.grad.add_(copy.grad)
        copy.grad = None

    return hook


__all__ = ["ComputeCopies"]
