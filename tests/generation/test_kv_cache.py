"""KVCache: the shape it allocates, its size, and copies between slots, against hand-worked expectations."""

from __future__ import annotations

import torch

from torchrlhf.generation.kv_cache import KVCache
from torchrlhf.generation.model import ModelDims


def _numbered(layers: int = 2, slots: int = 4, seq: int = 6) -> KVCache:
    """A cache whose key at (layer, slot, position) is 100 * layer + 10 * slot + position (values: negated)."""
    cache = KVCache(ModelDims(num_layers=layers, num_kv_heads=1, head_dim=1), slots, seq, torch.device("cpu"),
                    torch.float32)
    for layer in range(layers):
        for slot in range(slots):
            for pos in range(seq):
                cache.k[layer, slot, pos] = 100 * layer + 10 * slot + pos
    cache.v.copy_(-cache.k)
    return cache


def test_the_cache_is_allocated_at_its_largest_with_a_scratch_position():
    cache = KVCache(ModelDims(num_layers=3, num_kv_heads=2, head_dim=8), 5, 16, torch.device("cpu"), torch.bfloat16)
    assert cache.k.shape == cache.v.shape == (3, 5, 16, 2, 8)
    assert cache.nbytes() == 2 * 3 * 5 * 16 * 2 * 8 * 2  # keys and values, 2 bytes each
    assert cache.scratch == 15 and cache.prefixes == {}


def test_copy_moves_the_first_positions_of_every_layer_and_nothing_else():
    cache = _numbered()
    cache.copy([3], [1], 4)
    for layer in range(2):
        assert cache.k[layer, 3, :, 0, 0].tolist() == [100 * layer + 10 + p for p in range(4)] + [
            100 * layer + 34, 100 * layer + 35]
        assert cache.v[layer, 3, :4, 0, 0].tolist() == [-(100 * layer + 10 + p) for p in range(4)]
        assert cache.k[layer, 1, :, 0, 0].tolist() == [100 * layer + 10 + p for p in range(6)]  # source kept


def test_copy_reads_every_source_before_it_writes():
    """Slots 0 and 1 swap: a copy that wrote slot 0 before reading it would give slot 1 its own values."""
    cache = _numbered()
    cache.copy([0, 1], [1, 0], 6)
    assert cache.k[0, 0, :, 0, 0].tolist() == [10 + p for p in range(6)]
    assert cache.k[1, 1, :, 0, 0].tolist() == [100 + p for p in range(6)]
