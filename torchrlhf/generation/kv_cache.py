"""The native engine's keys and values: one pre-allocated row of positions per slot.

A slot is one sample's place in the cache: its keys and values sit at positions ``0 .. length - 1`` of its
row, in every layer. The cache is allocated once, at its largest (slots x ``max_seq_len``), so the decode
step writes in place and never grows a tensor (on a GPU a graph replays over the same addresses).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrlhf.generation.model import ModelDims


class KVCache:
    """Keys and values of every slot, ``[layers, slots, max_seq_len, kv_heads, head_dim]`` each.

    ``prefixes`` is the prefix cache: free slot -> the tokens whose keys/values it still holds, valid while
    the weights stay the same (`SlotPool` reads and updates it; the engine empties it when weights change).
    The last position, ``scratch``, belongs to no sample: a decode row with nothing to compute writes there.
    """

    def __init__(self, dims: ModelDims, slots: int, max_seq_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        shape = (dims.num_layers, slots, max_seq_len, dims.num_kv_heads, dims.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.prefixes: dict[int, list[int]] = {}
        self.scratch = max_seq_len - 1

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def copy(self, dst: Sequence[int], src: Sequence[int], length: int) -> None:
        """Copy the first ``length`` positions of slots ``src`` into slots ``dst``, in every layer (the
        sources are read before anything is written, so a slot may be both)."""
        d = torch.tensor(list(dst), device=self.k.device)
        s = torch.tensor(list(src), device=self.k.device)
        self.k[:, d, :length] = self.k[:, s, :length]
        self.v[:, d, :length] = self.v[:, s, :length]
