"""CUDA-graph decode: same tokens and log-probs as eager decode and as transformers.

The GPU tests are skipped without CUDA (CI has none); they ran on a lent H100.
"""

from __future__ import annotations

import pytest
import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams
from torchrlhf.generation.cuda_graphs import GraphedDecode, _span_bucket

from gen_helpers import hf_greedy, left_padded, tiny_model

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LENGTHS = [5, 9, 3, 7, 6, 4, 8]


def prompts(lengths=LENGTHS, device="cpu") -> Batch:
    ids, mask = left_padded(lengths)
    return Batch({"input_ids": ids.to(device), "attention_mask": mask.to(device)})


def test_span_buckets_are_powers_of_two_capped_at_the_pool():
    assert [_span_bucket(s, 64) for s in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert _span_bucket(40, 48) == 48


def test_cpu_engine_decodes_eagerly():
    engine = NativeEngine(tiny_model(), max_batch_size=2, max_seq_len=32, cuda_graphs=True)
    assert not engine.use_cuda_graphs and engine.decode_fn() == engine.decoder.decode
    with pytest.raises(ValueError, match="CUDA device"):
        GraphedDecode(engine.decode_step, engine.cache.k, engine.cache.v)


@requires_cuda
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_graphed_greedy_equals_hf_generate(family):
    model = tiny_model(family).cuda()
    batch = prompts(device="cuda")
    engine = NativeEngine(model, max_batch_size=4, max_seq_len=64, device="cuda")
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert engine.use_cuda_graphs and len(engine._graphed.graphs) >= 1
    assert torch.equal(out["responses"], hf_greedy(model, batch, 12))


@requires_cuda
def test_graphed_sampling_matches_eager_with_continuous_batching():
    """Seeded top-p sampling with early stops: slots refill and spans shrink, so several buckets are replayed."""
    model = tiny_model().cuda()
    batch = prompts(device="cuda")
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=20, stop_token_ids=[33, 61, 91], seed=7)
    graphed = NativeEngine(model, max_batch_size=8, max_seq_len=64, device="cuda")
    eager = NativeEngine(model, max_batch_size=8, max_seq_len=64, device="cuda", cuda_graphs=False)
    a, b = graphed.generate(batch, params), eager.generate(batch, params)
    assert len(graphed._graphed.graphs) >= 2, graphed._graphed.graphs.keys()
    assert torch.equal(a["responses"], b["responses"])
    assert a["finish_reason"] == b["finish_reason"] and "stop" in a["finish_reason"]
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5, rtol=1e-5)


@requires_cuda
def test_graphs_are_recaptured_after_release_and_use_new_weights(tmp_path):
    model_a, model_b = tiny_model(seed=0), tiny_model(seed=1)
    model_a.save_pretrained(tmp_path)
    engine = NativeEngine(tmp_path, max_batch_size=4, max_seq_len=64, device="cuda")
    batch = prompts(device="cuda")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.generate(batch, params)
    engine.release()
    assert engine._graphed is None
    engine.resume()
    engine.update_weights((name, p.detach().cuda()) for name, p in model_b.named_parameters())
    out = engine.generate(batch, params)
    assert torch.equal(out["responses"], hf_greedy(model_b.cuda(), batch, 8))


@requires_cuda
def test_every_bucket_is_captured_by_the_first_generate():
    """Capture once: the second generate (other prompt lengths, other spans) replays and captures nothing."""
    model = tiny_model().cuda()
    engine = NativeEngine(model, max_batch_size=8, max_seq_len=600, device="cuda")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.generate(prompts(device="cuda"), params)
    graphed = engine._graphed
    assert sorted(graphed.graphs) == graphed.buckets() and len(graphed.buckets()) == 4 * 3  # spans 1..8, KV 256..600
    captured = dict(graphed.graphs)
    out = engine.generate(prompts([2, 11, 4], device="cuda"), params)
    assert engine._graphed is graphed and graphed.graphs == captured
    assert torch.equal(out["responses"], hf_greedy(model, prompts([2, 11, 4], device="cuda"), 12))


@requires_cuda
def test_compiled_graphed_decode_equals_hf_generate():
    model = tiny_model().cuda()
    batch = prompts(device="cuda")
    engine = NativeEngine(model, max_batch_size=8, max_seq_len=64, device="cuda", compile=True)
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert torch.equal(out["responses"], hf_greedy(model, batch, 12))
