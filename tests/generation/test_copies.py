"""Copies in generation, counted by the profiler: counts, not times, so they hold on any host.

The engine writes each layer's new keys and values into its cache in place (one ``index_put_`` per layer and step,
`generation.model`) and copies streamed weights straight into its own parameters (`NativeEngine.update_weights`).
A regression to a copy per layer (a cache write through ``copy_``) or to an intermediate buffer per weight shows
here as a count that grows with the model's depth or a second copy per tensor. Copies of 0-dimensional tensors
are left out of the generation count: Python numbers that aten wraps as 0-dimensional host tensors and casts to the
operand's dtype inside an op (``aten::to`` under the op, so below any Python-level hook), two per RMSNorm and
forward: the divide by the count in ``mean`` and ``variance + eps`` (`LlamaRMSNorm`), plus one per step in
sampling's ``isfinite``. They move no tensor data, and on a GPU a wrapped number reaches the kernel as an argument,
not by a host-to-device copy. Measured over one 16-token generate: 176 of 354 copies at 2 layers, 304 of 482 at 4
(found with the profiler's parent events: ``aten::_to_copy < aten::to < aten::div_ < aten::mean`` 80 times, ``<
aten::add`` 80, ``< aten::ne < aten::isfinite`` 16).
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from torchrlhf.generation import NativeEngine, SamplingParams

from gen_helpers import prompt_batch, tiny_model


def _copies(fn, scalars: bool = True) -> int:
    """``aten::copy_`` calls while ``fn`` runs (``scalars=False``: only those of tensors with a dimension)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return sum(e.count for e in prof.key_averages(group_by_input_shape=True)
               if e.key == "aten::copy_" and (scalars or any(e.input_shapes[0:1])))


def _generation_copies(layers: int, lengths: list[int]) -> int:
    engine = NativeEngine(tiny_model(num_hidden_layers=layers), max_batch_size=8, max_seq_len=96)
    sampling = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=0)
    engine.generate(prompt_batch(lengths), sampling)  # warm: lazily built buffers are not the steady state
    return _copies(lambda: engine.generate(prompt_batch(lengths), sampling), scalars=False)


def test_weights_stream_into_the_engine_with_one_copy_per_tensor():
    model = tiny_model()
    engine = NativeEngine(model, max_batch_size=2, max_seq_len=64)
    named = [(name, p.detach().clone()) for name, p in model.named_parameters()]
    assert _copies(lambda: engine.update_weights(named)) == len(named)


def test_generation_copies_grow_with_neither_depth_nor_prompt_length():
    """Four layers generate with as many ``copy_`` calls of tensors as two (the cache is written in place per
    layer), and prompts of 40 tokens with as many as prompts of 5 (the prompt's keys/values are written at
    prefill, not copied per token)."""
    short = [5, 9, 3, 7, 6]
    base = _generation_copies(2, short)
    assert _generation_copies(4, short) == base
    assert _generation_copies(2, [40, 36, 38, 33, 40]) == base
