"""The engine contract, once for every engine: each `RolloutEngine` passes the same suite against HF.

Greedy equals transformers' `generate`, the output columns, sampled-token log-probs equal a training
forward's, seeds independent of batch composition, stop ids and strings, invalid prompts, and streamed
weight updates that the next generation uses. Engine-specific behaviour is tested beside each engine
(test_engine.py, test_vllm_engine.py). vLLM's CPU attention needs head_dim >= 32, hence the wider model.
"""

from __future__ import annotations

import pytest
import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams, VLLMEngine, vllm_available

from gen_helpers import LENGTHS, forward_logits, hf_greedy, left_padded, prompt_batch, saved_model_pair

VLLM_OK, VLLM_WHY = vllm_available()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return saved_model_pair(tmp_path_factory.mktemp("engine_model_a"))


@pytest.fixture(scope="module", params=[
    "native",
    pytest.param("vllm", marks=pytest.mark.skipif(not VLLM_OK, reason=f"vLLM is not importable here: {VLLM_WHY}")),
])
def engine(request, models):
    """Each engine starts from model A's directory, as the rollout role builds it."""
    cls = {"native": NativeEngine, "vllm": VLLMEngine}[request.param]
    engine = cls(models[1], max_batch_size=4, max_seq_len=64)
    yield engine
    if hasattr(engine, "shutdown"):
        engine.shutdown()


def test_greedy_equals_hf_generate(models, engine):
    batch = prompt_batch()
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert torch.equal(out["responses"], hf_greedy(models[0], batch, 12))
    assert out["finish_reason"] == ["length"] * len(LENGTHS)


def test_output_columns_follow_the_contract(engine):
    batch = prompt_batch()
    out = engine.generate(batch, SamplingParams(n=2, max_tokens=6, seed=1, stop_token_ids=[5, 7, 11]))
    b, p = 2 * len(LENGTHS), batch["input_ids"].shape[1]
    assert out["responses"].shape == (b, 6) and out["input_ids"].shape == (b, p + 6)
    assert torch.equal(out["prompts"], batch["input_ids"].repeat_interleave(2, 0))
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"], torch.cat([batch["attention_mask"].repeat_interleave(2, 0), out["response_mask"]], 1))
    assert torch.equal(out["position_ids"], (out["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    assert out["rollout_log_probs"].dtype == torch.float32
    assert (out["rollout_log_probs"][out["response_mask"] == 0] == 0).all()
    assert (out["responses"][out["response_mask"] == 0] == 0).all()  # pad id
    assert out["uid"] == [u for u in batch["uid"] for _ in range(2)]
    assert out["raw_prompt"] == [r for r in batch["raw_prompt"] for _ in range(2)]
    assert {k: v for k, v in out.meta.items() if not k.startswith("rollout/")} == {"step": 3}  # + occupancy (native)
    lengths = out["response_mask"].sum(-1)
    for i, reason in enumerate(out["finish_reason"]):
        last = out["responses"][i, lengths[i] - 1].item()
        assert reason == ("stop" if last in (5, 7, 11, 2) else "length")  # 2: the tokenizer's EOS
        assert reason == "stop" or lengths[i] == 6


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_training_forward(models, engine, temperature):
    out = engine.generate(prompt_batch(), SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=3))
    logits = forward_logits(models[0], out) / (temperature or 1.0)
    mask = out["response_mask"]
    ref = torch.log_softmax(logits, -1).gather(-1, out["responses"][..., None])[..., 0] * mask
    gap = (out["rollout_log_probs"] - ref).abs()
    assert gap.max() < 1e-4, f"log-prob gap max {gap.max():.2e}, mean {gap[mask.bool()].mean():.2e}"
    if temperature == 0:  # greedy picks the argmax of the training forward
        assert torch.equal(out["responses"][mask.bool()], logits.argmax(-1)[mask.bool()])


def test_same_seed_same_samples_regardless_of_batch(engine):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11)
    alone = engine.generate(prompt_batch([6], seed=5), params)
    ids, mask = left_padded([6, 4, 9], seed=5)  # same first prompt, other company
    crowd = engine.generate(Batch({"input_ids": ids, "attention_mask": mask}), params)
    assert torch.equal(alone["responses"], crowd["responses"][:3])
    assert not torch.equal(crowd["responses"][0], crowd["responses"][1])  # samples differ from each other
    # With a per-prompt seed column the prompt's position does not matter either.
    ids2 = torch.cat([left_padded([9], seed=7)[0], ids[:1, :]], 0)
    mask2 = torch.cat([left_padded([9], seed=7)[1], mask[:1, :]], 0)
    moved = engine.generate(Batch({"input_ids": ids2, "attention_mask": mask2, "seed": torch.tensor([5, 11])}), params)
    assert torch.equal(moved["responses"][3:], alone["responses"])


def test_stop_token_ids_end_with_stop(engine):
    batch = prompt_batch()
    free = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop_id = free["responses"][0, 3].item()
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True))
    for i in range(len(batch)):
        row = free["responses"][i].tolist()
        n = row.index(stop_id) + 1 if stop_id in row else 12
        assert out["response_mask"][i].sum() == n
        assert out["responses"][i, :n].tolist() == row[:n]
        assert out["finish_reason"][i] == ("stop" if stop_id in row else "length")


def test_per_prompt_max_tokens_column_truncates_each_prompt(engine):
    """A ``max_tokens`` column gives each prompt its own budget (capped by the call's): the samples are the
    unbudgeted samples cut at the budget, finishing with "length" there."""
    batch = prompt_batch()
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=4, ignore_eos=True)
    free = engine.generate(batch, params)
    budgets = [3, 10, 1, 7, 12][: len(batch)]
    batch["max_tokens"] = torch.tensor(budgets)
    out = engine.generate(batch, params)
    for i in range(2 * len(batch)):
        n = min(budgets[i // 2], 10)
        assert out["response_mask"][i].sum() == n, (i, out["response_mask"][i])
        assert torch.equal(out["responses"][i, :n], free["responses"][i, :n])
        torch.testing.assert_close(out["rollout_log_probs"][i, :n], free["rollout_log_probs"][i, :n])
        assert out["finish_reason"][i] == "length"
    batch["max_tokens"] = torch.tensor([0] * len(batch))
    with pytest.raises(ValueError, match="max_tokens column of 0"):
        engine.generate(batch, params)


def test_stop_strings_end_with_stop(engine):
    batch = prompt_batch()
    decode = lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    free = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stop = decode(free["responses"][0])[4:6]
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))
    for i in range(len(batch)):
        row = free["responses"][i].tolist()
        n = next((k for k in range(1, 13) if stop in decode(row[:k])), 12)  # the token completing the string
        assert out["response_mask"][i].sum() == n
        assert out["responses"][i, :n].tolist() == row[:n]
        assert out["finish_reason"][i] == ("stop" if stop in decode(row) else "length")
    assert out["finish_reason"][0] == "stop"


def test_a_prompt_too_long_is_named(engine):
    with pytest.raises(ValueError, match=r"prompt 1 has 9 tokens.*64 - 58 = 6"):
        engine.generate(prompt_batch([3, 9]), SamplingParams(max_tokens=58))


def test_logprobs_off_drops_the_column(engine):
    out = engine.generate(prompt_batch([4]), SamplingParams(max_tokens=3, logprobs=False, seed=0))
    assert "rollout_log_probs" not in out and out["responses"].shape == (1, 3)


def test_update_weights_streams_new_weights(models, engine):
    model_a, _, model_b = models
    batch = prompt_batch()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert set(engine.param_shard_dims().values()) == {None}
    assert not torch.equal(hf_greedy(model_a, batch, 8), hf_greedy(model_b, batch, 8))
    engine.generate(batch, params)  # fill the prefix cache with model A's KV

    # B's tensors arrive as two lazy streams; the tied lm_head comes too, as an alias of the embedding.
    named = list(model_b.named_parameters(remove_duplicate=False))
    assert "lm_head.weight" in dict(named)
    engine.release()
    engine.resume(("weights",))
    engine.update_weights((n, p.detach().clone()) for n, p in named if ".layers.0." in n)
    engine.update_weights((n, p.detach().double()) for n, p in named if ".layers.0." not in n)  # cast on copy
    engine.resume(("kv_cache",))
    assert torch.equal(engine.generate(batch, params)["responses"], hf_greedy(model_b, batch, 8))

    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        engine.update_weights([("model.norm.weight", model_a.model.norm.weight.detach()), ("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])

    engine.update_weights((n, p.detach()) for n, p in model_a.named_parameters())  # back to A, for the other tests
    assert torch.equal(engine.generate(batch, params)["responses"], hf_greedy(model_a, batch, 8))

