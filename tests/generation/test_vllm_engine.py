"""VLLMEngine's own behaviour (the shared contract is in test_engine_contract.py): no tokenizer, filtered log-probs.

One vLLM engine serves the module (each start costs ~10 s on CPU); tests that change its weights put
model A's back. vLLM's CPU attention needs head_dim >= 32, hence the wider tiny model.
"""

from __future__ import annotations

import pytest
import torch

from torchrlhf.generation import SamplingParams, VLLMEngine, vllm_available

from gen_helpers import WIDE, forward_logits, hf_greedy, prompt_batch, saved_model_pair, tiny_model

available, why = vllm_available()
if not available:
    pytest.skip(f"vLLM is not importable here ({why})", allow_module_level=True)



def test_a_moe_model_generates_and_takes_the_trainers_stacked_expert_weights(tmp_path):
    """Qwen3-MoE on vLLM: greedy equals transformers'; weights sent under the training model's names (each
    layer's experts stacked, as transformers holds them) load into vLLM's per-expert checkpoint layout, and the
    next generation is the second model's greedy. Its own engine, started and shut down here."""
    first, second = (tiny_model("qwen3_moe", seed=s, head_dim=32, **WIDE) for s in (0, 1))
    first.save_pretrained(tmp_path)
    batch = prompt_batch()
    engine = VLLMEngine(tmp_path, max_batch_size=4, max_seq_len=64)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        assert torch.equal(engine.generate(batch, greedy)["responses"], hf_greedy(first, batch, 12))
        names = dict(second.named_parameters())
        assert set(engine.param_names()) == set(names)  # stacked names, as the trainer sends them
        assert engine.param_local_shapes()["model.layers.0.mlp.experts.gate_up_proj"] == \
            names["model.layers.0.mlp.experts.gate_up_proj"].shape
        engine.update_weights(names.items())
        assert torch.equal(engine.generate(batch, greedy)["responses"], hf_greedy(second, batch, 12))
    finally:
        engine.shutdown()


def test_without_a_tokenizer_eos_comes_from_the_generation_config(tmp_path):
    """No tokenizer files: vLLM runs without one; EOS still ends samples, stop strings are refused.

    First in the file: it builds (and shuts down) its own engine before the module's engine exists.
    """
    model = tiny_model("llama", seed=2, **WIDE)
    batch = prompt_batch()
    free = hf_greedy(model, batch, 12)
    eos = free[0, 3].item()
    model.generation_config.eos_token_id = eos
    model.save_pretrained(tmp_path)
    engine = VLLMEngine(tmp_path, max_batch_size=4, max_seq_len=64)
    try:
        assert engine.tokenizer is None
        out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12))
        with pytest.raises(ValueError, match="needs a tokenizer"):
            engine.generate(batch, SamplingParams(max_tokens=4, stop=["x"]))
    finally:
        engine.shutdown()
    for i in range(len(batch)):
        row = free[i].tolist()
        n = row.index(eos) + 1 if eos in row else 12
        assert out["response_mask"][i].sum() == n and out["responses"][i, :n].tolist() == row[:n]
        assert out["finish_reason"][i] == ("stop" if eos in row else "length")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return saved_model_pair(tmp_path_factory.mktemp("vllm_model_a"))


@pytest.fixture(scope="module")
def engine(models):
    engine = VLLMEngine(models[1], max_batch_size=4, max_seq_len=64)
    yield engine
    engine.shutdown()


def test_starting_an_engine_leaves_the_callers_process_state(models, monkeypatch):
    """vLLM's CPU platform rewrites LD_PRELOAD (for its own children) and LOCAL_WORLD_SIZE (torchrun's) and
    lowers the thread count; a rank that trains after starting its engine, or spawns processes, needs
    them as they were."""
    import os

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "7")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    torch.set_num_threads(2)
    engine = VLLMEngine(models[1], max_batch_size=2, max_seq_len=32)
    try:
        assert os.environ["LOCAL_WORLD_SIZE"] == "7" and "LD_PRELOAD" not in os.environ
        assert torch.get_num_threads() == 2
    finally:
        engine.shutdown()
        torch.set_num_threads(1)


def test_top_k_logprobs_are_renormalised_over_the_kept_tokens(models, engine):
    """The documented difference from NativeEngine: with a filter on, vLLM's log-probs are the filtered ones."""
    out = engine.generate(prompt_batch(), SamplingParams(n=3, temperature=1.5, top_k=3, max_tokens=8, seed=0))
    logits = forward_logits(models[0], out) / 1.5
    top3 = logits.topk(3, dim=-1)
    mask = out["response_mask"].bool()
    assert (top3.indices == out["responses"][..., None]).any(-1)[mask].all()  # never leaves the top 3
    kept = torch.full_like(logits, float("-inf")).scatter(-1, top3.indices, top3.values)
    ref = torch.log_softmax(kept, -1).gather(-1, out["responses"][..., None])[..., 0]
    torch.testing.assert_close(out["rollout_log_probs"][mask], ref[mask], atol=1e-4, rtol=1e-4)


def test_invalid_requests_raise(engine):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(prompt_batch([3]), SamplingParams(temperature=2.5, max_tokens=4))
    with pytest.raises(ValueError, match="tp_mesh"):
        VLLMEngine("unused", tp_mesh=type("Mesh", (), {"size": lambda self: 2})())
    with pytest.raises(ValueError, match="device index 0 only"):
        VLLMEngine("unused", device="cuda:1")

def test_a_fused_module_sent_in_part_is_refused(models, engine):
    """vLLM loads q/k/v as one qkv_proj: q alone would leave it half defined, so that raises."""
    model_a = models[0]
    with pytest.raises(ValueError, match=r"qkv_proj.*k_proj"):
        engine.update_weights([("model.layers.1.self_attn.q_proj.weight", model_a.model.layers[1].self_attn.q_proj.weight)])
    engine.update_weights((n, p.detach()) for n, p in model_a.named_parameters())  # whole again, for other tests


def test_shutdown_survives_a_child_that_exits_while_vllm_names_it():
    """vLLM's force kill names each child of a stuck engine process first; one that exits in between raises
    psutil.NoSuchProcess out of its shutdown. The engine runs the shutdown again for the rest."""
    import types

    import psutil

    calls = []

    def shutdown():
        calls.append(1)
        if len(calls) == 1:
            raise psutil.NoSuchProcess(12345)

    engine = object.__new__(VLLMEngine)
    engine.llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(
        engine_core=types.SimpleNamespace(shutdown=shutdown)))
    engine.shutdown()
    assert len(calls) == 2
