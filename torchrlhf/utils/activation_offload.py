"""Keep a forward's saved activations in host memory until its backward.

Shared-prefix training runs each mini-batch's prompts once, then every suffix micro-batch, and only then
the prompts' backward (`workers.shared_prefix`). Everything autograd saved in the prompt pass waits on the
device through all the suffix passes, beside each suffix micro-batch's own activations. Offloading it, as
*Schedule-Level Shared-Prefix Reuse for LLM RL Training* does, leaves only the prompts' keys/values (which the
suffix passes read) on the device meanwhile; the saved tensors come back one by one as the prompts' backward
reaches them.

This uses `torch.autograd.graph.saved_tensors_hooks`. Parameters stay where they are: a layer's backward
reads its own weight, and copying weights out would only add traffic.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class OffloadStats:
    """What one offloaded forward moved: tensors and bytes held on the host."""

    tensors: int = 0
    bytes: int = 0


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def host_bytes_available() -> int:
    """This process's share of the host's available memory: ``MemAvailable`` over the ranks on the node
    (``LOCAL_WORLD_SIZE``, which torchrun sets), 90 % of it, so that offloading ranks leave room for the rest."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(0.9 * available / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1))


@contextmanager
def saved_tensors_on(host: torch.device | str = "cpu", *, limit_bytes: int | None = None,
                     what: str = "offloaded activations") -> Iterator[OffloadStats]:
    """Within the block, every tensor autograd saves for backward (parameters aside) is copied to ``host``
    and copied back to its device when backward unpacks it.

    Host copies from a CUDA device are pinned and asynchronous on the current stream, so they stay ordered
    with the kernels that produce and later read them. On a CPU device the copies free nothing; they are
    made anyway so the path is the one a GPU runs. The yielded `OffloadStats` counts what was moved.
    ``limit_bytes``: more than this on the host raises a `RuntimeError` naming ``what`` before the copy that
    would pass it (an out-of-memory kill of the host would lose the run without a word).
    """
    host = torch.device(host)
    stats = OffloadStats()

    def pack(t: torch.Tensor):
        if _is_parameter(t):
            return t
        nbytes = t.numel() * t.element_size()
        if limit_bytes is not None and stats.bytes + nbytes > limit_bytes:
            raise RuntimeError(
                f"{what}: the host memory this rank may use ({limit_bytes / 2**30:.2f} GiB: 90 % of MemAvailable "
                f"over the node's ranks) is too small: {stats.tensors} tensors ({stats.bytes / 2**30:.2f} GiB) "
                f"held, the next needs {nbytes / 2**20:.1f} MiB. Turn the offload off, or lower the tokens per "
                "mini-batch")
        pin = t.device.type == "cuda" and host.type == "cpu"
        held = torch.empty_like(t, device=host, pin_memory=pin)
        held.copy_(t, non_blocking=pin)
        stats.tensors += 1
        stats.bytes += nbytes
        return t.device, held

    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, held = packed
        return held.to(device, non_blocking=held.is_pinned())

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield stats


__all__ = ["OffloadStats", "host_bytes_available", "saved_tensors_on"]
