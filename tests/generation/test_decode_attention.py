"""The flash-decoding kernel (`generation.decode_attention`) against attention computed slot by slot in fp32.

The kernel needs CUDA and Triton (CI has neither: those tests ran on a lent H200 through `tools/gpu_check.py`).
On CPU the engine's plumbing around it is tested with the kernel replaced by the slow reference.
"""

from __future__ import annotations

import pytest
import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams
from torchrlhf.generation import decode_attention as kernel

from gen_helpers import hf_greedy, left_padded, tiny_model

requires_kernel = pytest.mark.skipif(not kernel.available(torch.device("cuda")) or not torch.cuda.is_available(),
                                     reason="needs a CUDA device and triton")


def test_keys_split_only_when_slots_and_heads_leave_processors_idle():
    # 128 slots x 8 KV heads fill 132 processors twice over: one split
    assert kernel.num_splits(128, 8, 320, processors=132, block_n=64) == 1
    # 2 x 8 programs want 17 splits for two per processor; 320 keys are 5 blocks of 64
    assert kernel.num_splits(2, 8, 320, processors=132, block_n=64) == 5
    # one slot, one KV head, long keys: capped
    assert kernel.num_splits(1, 1, 1 << 16, processors=132, block_n=64) == kernel.MAX_SPLITS


def test_the_engine_refuses_the_kernel_where_it_cannot_run_and_unknown_choices():
    with pytest.raises(ValueError, match="decode_attention='triton' needs a CUDA device"):
        NativeEngine(tiny_model(), max_batch_size=2, max_seq_len=32, decode_attention="triton")
    with pytest.raises(ValueError, match="'auto', 'sdpa' or 'triton'"):
        NativeEngine(tiny_model(), max_batch_size=2, max_seq_len=32, decode_attention="flash")
    assert not NativeEngine(tiny_model(), max_batch_size=2, max_seq_len=32).decoder.decode_kernel


def test_kernel_decode_plumbing_gives_hf_greedy_tokens(monkeypatch):
    """Decode steps through the op (positions, layer and heads as the engine passes them), its math replaced by
    the reference: the tokens of transformers' greedy generate, with continuous batching and early stops."""
    seen = []

    def slow(q, k, v, positions, kv_len, scale, processors):
        seen.append((q.shape[0], kv_len))
        assert int(positions.max()) < kv_len
        return kernel.reference(q, k, v, positions, scale)

    monkeypatch.setattr(kernel, "launch", slow)
    model = tiny_model()
    ids, mask = left_padded([5, 9, 3, 7, 6])
    batch = Batch({"input_ids": ids, "attention_mask": mask})
    engine = NativeEngine(model, max_batch_size=3, max_seq_len=48)
    engine.decoder.decode_kernel = True
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert seen and {b for b, _ in seen} >= {3}
    assert torch.equal(out["responses"], hf_greedy(model, batch, 10))


@requires_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("slots,heads,kv_heads,head_dim,kv_len", [
    (128, 32, 8, 64, 320),  # the 1.07 B shape at batch 128: one split
    (2, 32, 8, 64, 320),  # few slots: split keys, merged
    (3, 24, 8, 128, 1000),  # 3 query heads per KV head, head dim 128
    (5, 9, 3, 40, 77),  # nothing a power of two
])
def test_kernel_equals_slot_by_slot_attention(dtype, slots, heads, kv_heads, head_dim, kv_len):
    torch.manual_seed(0)
    layers, max_seq = 2, kv_len + 8
    k = torch.randn(layers, slots + 1, max_seq, kv_heads, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(slots, heads, 1, head_dim, device="cuda", dtype=dtype)[:, :, 0]  # strided as the engine's
    positions = torch.randint(0, kv_len, (slots,), device="cuda")
    positions[0], positions[-1] = 0, kv_len - 1
    out = kernel.decode_attention(q, k, v, 1, positions, kv_len, head_dim ** -0.5)
    ref = kernel.reference(q, k[1], v[1], positions, head_dim ** -0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@requires_kernel
@pytest.mark.parametrize("compile", [False, True])
def test_graphed_kernel_decode_equals_hf_greedy(compile):
    model = tiny_model().cuda()
    ids, mask = left_padded([5, 9, 3, 7, 6, 4, 8])
    batch = Batch({"input_ids": ids.cuda(), "attention_mask": mask.cuda()})
    engine = NativeEngine(model, max_batch_size=4, max_seq_len=64, device="cuda", compile=compile)
    assert engine.decoder.decode_kernel and engine.use_cuda_graphs
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert torch.equal(out["responses"], hf_greedy(model, batch, 12))
