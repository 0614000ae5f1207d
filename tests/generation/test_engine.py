"""NativeEngine against transformers on every family (the shared contract is in test_engine_contract.py)."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams

from gen_helpers import (LENGTHS, CharTokenizer, HostReads, forward_logits, hf_greedy, left_padded, prompt_batch,
                         tiny_model)



@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"])
def test_greedy_equals_hf_generate(family):
    model = tiny_model(family)
    batch = prompt_batch()
    engine = NativeEngine(model, max_batch_size=2, max_seq_len=64)
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert torch.equal(out["responses"], hf_greedy(model, batch, 12))
    assert out["finish_reason"] == ["length"] * len(LENGTHS)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generation_runs_the_models_own_layers(family):
    """Whatever the family's layer computes, generation computes: a gelu MLP and attention bias, which no
    second copy of the layer math would know, still give exactly HF's greedy tokens."""
    model = tiny_model(family, hidden_act="gelu_pytorch_tanh", attention_bias=True)
    batch = prompt_batch()
    out = NativeEngine(model, max_batch_size=2, max_seq_len=64).generate(
        batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert torch.equal(out["responses"], hf_greedy(model, batch, 12))


@pytest.mark.parametrize("family, temperature", [("qwen2", 1.0), ("qwen2", 0.7), ("qwen2", 0.0),
                                                 ("qwen3_moe", 1.0)])
def test_logprobs_match_training_forward(family, temperature):
    model = tiny_model(family)
    batch = prompt_batch()
    out = NativeEngine(model, max_batch_size=3, max_seq_len=64).generate(
        batch, SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=3)
    )
    logits = forward_logits(model, out) / (temperature or 1.0)
    ref = torch.log_softmax(logits, -1).gather(-1, out["responses"][..., None])[..., 0] * out["response_mask"]
    torch.testing.assert_close(out["rollout_log_probs"], ref, atol=1e-4, rtol=1e-4)
    if temperature == 0:  # greedy picks the argmax of the training forward
        mask = out["response_mask"].bool()
        assert torch.equal(out["responses"][mask], logits.argmax(-1)[mask])


def test_top_k_never_leaves_the_top_k():
    model = tiny_model()
    out = NativeEngine(model, max_batch_size=4, max_seq_len=64).generate(
        prompt_batch(), SamplingParams(n=4, temperature=1.5, top_k=3, max_tokens=10, seed=0)
    )
    top3 = forward_logits(model, out).topk(3, dim=-1).indices
    mask = out["response_mask"].bool()
    assert (top3 == out["responses"][..., None]).any(-1)[mask].all()


def test_same_seed_same_samples_regardless_of_batch():
    model = tiny_model()
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=11)
    alone = NativeEngine(model, max_batch_size=8, max_seq_len=64).generate(prompt_batch([6], seed=5), params)
    ids, mask = left_padded([6, 4, 9], seed=5)  # same first prompt, other company, fewer slots
    crowd = NativeEngine(model, max_batch_size=2, max_seq_len=64).generate(
        Batch({"input_ids": ids, "attention_mask": mask}), params
    )
    assert torch.equal(alone["responses"], crowd["responses"][:3])
    assert not torch.equal(crowd["responses"][0], crowd["responses"][1])  # samples differ from each other
    # With a per-prompt seed column the prompt's position does not matter either.
    ids2 = torch.cat([left_padded([9], seed=7)[0], ids[:1, :]], 0)
    mask2 = torch.cat([left_padded([9], seed=7)[1], mask[:1, :]], 0)
    moved = NativeEngine(model, max_batch_size=4, max_seq_len=64).generate(
        Batch({"input_ids": ids2, "attention_mask": mask2, "seed": torch.tensor([5, 11])}), params
    )
    assert torch.equal(moved["responses"][3:], alone["responses"])


def test_continuous_batching_matches_running_alone():
    model = tiny_model()
    lengths = [4, 8, 3, 10, 5, 7, 6]
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[61, 33, 43, 91])
    together = NativeEngine(model, max_batch_size=3, max_seq_len=64).generate(prompt_batch(lengths), params)
    engine = NativeEngine(model, max_batch_size=1, max_seq_len=64)
    alone = Batch.concat([engine.generate(prompt_batch(lengths)[i], params) for i in range(len(lengths))])
    assert len(set(together["response_mask"].sum(-1).tolist())) > 1  # slots really finished at different times
    for i in range(len(lengths)):
        n = int(alone["response_mask"][i].sum())
        assert together["response_mask"][i].sum() == n
        assert torch.equal(together["responses"][i, :n], alone["responses"][i, :n])
        torch.testing.assert_close(together["rollout_log_probs"][i], alone["rollout_log_probs"][i], atol=1e-5, rtol=1e-5)
    assert together["finish_reason"] == alone["finish_reason"]


@pytest.mark.parametrize("check_every", [3, 8])
def test_looking_every_k_steps_changes_no_sample(check_every):
    """Slots end on the device and the host frees them every k steps (continuous batching refills them
    then): every token, log-prob and finish reason is what looking every step gives."""
    model = tiny_model()
    lengths = [4, 8, 3, 10, 5, 7, 6]
    params = SamplingParams(n=2, temperature=0.8, max_tokens=12, stop_token_ids=[61, 33, 43, 91], seed=5)
    batch = prompt_batch(lengths)
    batch["max_tokens"] = torch.tensor([12, 3, 12, 1, 12, 7, 12])  # per-prompt limits end slots too
    every = NativeEngine(model, max_batch_size=3, max_seq_len=64, check_every=1).generate(batch, params)
    lazy = NativeEngine(model, max_batch_size=3, max_seq_len=64, check_every=check_every).generate(batch, params)
    assert {"stop", "length"} <= set(every["finish_reason"])
    assert lazy["finish_reason"] == every["finish_reason"]
    assert torch.equal(lazy["response_mask"], every["response_mask"])
    assert torch.equal(lazy["responses"], every["responses"])
    torch.testing.assert_close(lazy["rollout_log_probs"], every["rollout_log_probs"], atol=1e-5, rtol=1e-5)


def test_compiled_decode_samples_what_the_eager_step_does():
    """``compile=True`` runs the decode step through torch.compile (the KV write stays in place): greedy
    tokens are transformers' own, and seeded sampling with stops and refills is the eager engine's. One
    compilation serves every span: the greedy run steps 3 slots, then 1 (the fourth prompt alone), and the
    sampled one every span from 1 to 3 without compiling again."""
    model = tiny_model()
    batch = prompt_batch([4, 8, 3, 6])
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    compiled = NativeEngine(model, max_batch_size=3, max_seq_len=64, compile=True)
    assert torch.equal(compiled.generate(batch, greedy)["responses"], hf_greedy(model, batch, 10))
    params = SamplingParams(n=2, temperature=0.8, max_tokens=12, stop_token_ids=[61, 33, 43, 91], seed=5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        a = compiled.generate(batch, params)
    b = NativeEngine(model, max_batch_size=3, max_seq_len=64).generate(batch, params)
    assert "stop" in a["finish_reason"] and a["finish_reason"] == b["finish_reason"]
    assert torch.equal(a["responses"], b["responses"])
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("check_every, per_step", [(1, 1.0), (8, 1 / 8)])
def test_steady_decode_reads_from_the_device_once_per_look(check_every, per_step):
    """Sampling, stop ids and length limits stay on the device: the steady decode loop reads values back
    once per ``check_every`` steps (the host's look), counted as the extra reads of 64 more steps."""
    engine = NativeEngine(tiny_model(), max_batch_size=4, max_seq_len=160, check_every=check_every)

    def reads(max_tokens: int) -> int:
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)
        with HostReads() as mode:
            engine.generate(prompt_batch([4, 8, 3, 6]), params)
        return mode.count

    assert reads(128) - reads(64) == pytest.approx(64 * per_step, abs=1)


def test_observations_ride_in_a_decode_step_reading_nothing_from_the_device():
    """An agent's turn boundary: two slots append observations of different lengths (so one row is padded) in
    the forward of a third slot's decode step. The forward reads no value back to the host (a GPU would wait
    for it), and every logit equals HF's forward over the whole sequence, including the next decode step of
    the padded row, which reads the positions its padding wrote."""
    model = tiny_model()
    engine = NativeEngine(model, max_batch_size=4, max_seq_len=64)
    dec, k, v = engine.decoder, engine.cache.k, engine.cache.v
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (6, 9, 4)]
    toks, lens = torch.zeros(3, 9, dtype=torch.long), torch.tensor([6, 9, 4])
    for i, q in enumerate(seqs):
        toks[i, : len(q)] = torch.tensor(q)
    dec.prefill(toks, lens, torch.arange(3), k, v)
    # slot 0 decodes its next token; slots 1 and 2 append 2 and 5 tokens after what they hold. Slot 1 is in the
    # decode span too, as a parked slot is: its row writes junk at position 9, which its first appended token
    # must overwrite.
    nxt = torch.randint(3, 96, (1,), generator=g).tolist()
    obs = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (2, 5)]
    ext = torch.zeros(2, 5, dtype=torch.long)
    for i, o in enumerate(obs):
        ext[i, : len(o)] = torch.tensor(o)
    with HostReads() as reads:
        logits, riding = dec.decode_and_extend(
            torch.tensor(nxt + [0]), torch.tensor([6, 9]), 2, 10, ext, torch.tensor([9, 4]), torch.tensor([2, 5]),
            torch.tensor([1, 2]), 11, k, v)
    assert reads.count == 0
    after = torch.randint(3, 96, (1,), generator=g).tolist()  # slot 1's next token, at position 11
    step = dec.decode(torch.tensor([0, after[0]]), torch.tensor([63, 11]), 2, 12, k, v)

    def hf_last(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, -1].float()

    torch.testing.assert_close(logits[0], hf_last(seqs[0] + nxt), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(riding[0], hf_last(seqs[1] + obs[0]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(riding[1], hf_last(seqs[2] + obs[1]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1], hf_last(seqs[1] + obs[0] + after), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("check_every", [1, 8])
def test_non_finite_logits_raise_naming_the_samples(check_every):
    model = tiny_model()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = float("nan")  # tied: the embedding of token 5 too
    engine = NativeEngine(model, max_batch_size=4, max_seq_len=64, check_every=check_every)
    with pytest.raises(FloatingPointError, match=r"samples \[0, 1, 2, 3\] is not finite"):
        engine.generate(prompt_batch([4, 8, 3, 6]), SamplingParams(temperature=1.0, max_tokens=16, seed=0))


def test_n_samples_share_the_prefill_and_greedy_agrees():
    model = tiny_model("qwen3")
    batch = prompt_batch()
    params = SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True)
    out = NativeEngine(model, max_batch_size=4, max_seq_len=64).generate(batch, params)
    ref = hf_greedy(model, batch, 8).repeat_interleave(3, 0)
    assert torch.equal(out["responses"], ref)


def test_prompt_too_long_names_the_sample():
    engine = NativeEngine(tiny_model(), max_batch_size=2, max_seq_len=16)
    with pytest.raises(ValueError, match=r"prompt 1 has 9 tokens.*16 - 8 = 8"):
        engine.generate(prompt_batch([5, 9]), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        engine.generate(prompt_batch([5]), SamplingParams(max_tokens=8, stop=["x"]))


def test_update_weights_release_resume(tmp_path):
    model_a, model_b = tiny_model(seed=0), tiny_model(seed=1)
    model_a.save_pretrained(tmp_path)
    engine = NativeEngine(tmp_path, CharTokenizer(), max_batch_size=4, max_seq_len=64)
    assert engine.owns_weights and set(engine.param_shard_dims().values()) == {None}
    batch = prompt_batch()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert torch.equal(engine.generate(batch, params)["responses"], hf_greedy(model_a, batch, 8))

    engine.release()
    assert engine.kv_cache_bytes() == 0
    with pytest.raises(RuntimeError, match="resume"):
        engine.generate(batch, params)
    engine.resume()
    with pytest.raises(RuntimeError, match="missing weights"):
        engine.generate(batch, params)
    engine.update_weights((name, p.detach()) for name, p in model_b.named_parameters())
    out = engine.generate(batch, params)
    assert torch.equal(out["responses"], hf_greedy(model_b, batch, 8))  # new weights are used

    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])


def test_engine_shares_the_models_tensors():
    model = tiny_model()
    engine = NativeEngine(model, max_batch_size=2, max_seq_len=32)
    assert engine.model.model.layers[0].self_attn.q_proj.weight is model.model.layers[0].self_attn.q_proj.weight
    engine.release()  # must not free a model the caller owns
    assert model.model.layers[0].mlp.up_proj.weight.untyped_storage().nbytes() > 0


def test_tail_compaction_keeps_results(monkeypatch):
    from torchrlhf.generation.scheduler import Scheduler

    calls = []
    original = Scheduler.compact
    monkeypatch.setattr(Scheduler, "compact", lambda self, live: (calls.append(list(live)), original(self, live)))
    model = tiny_model()
    lengths = [4, 8, 3, 10, 5, 7, 6, 9, 4, 6]
    params = SamplingParams(temperature=0, max_tokens=14, stop_token_ids=[61, 33, 43, 91, 22])
    together = NativeEngine(model, max_batch_size=8, max_seq_len=64).generate(prompt_batch(lengths), params)
    assert calls, "the run never compacted; pick stop ids that end more samples early"
    engine = NativeEngine(model, max_batch_size=1, max_seq_len=64)
    for i in range(len(lengths)):
        alone = engine.generate(prompt_batch(lengths)[i], params)
        assert torch.equal(together["responses"][i], alone["responses"][0])
        assert together["finish_reason"][i] == alone["finish_reason"][0]


def _greedy_with_swap(model_a, model_b, prompt: torch.Tensor, new_tokens: int, swap_at: int):
    """A slow reference: greedy tokens and log-probs where token ``t`` comes from model_a while ``t <
    swap_at`` and from model_b after; model_b continues on the cache model_a built (transformers)."""
    out = model_a(prompt[None], use_cache=True)
    past, logits, tokens, logps = out.past_key_values, out.logits[0, -1], [], []
    for t in range(new_tokens):
        if t > 0:
            model = model_a if t < swap_at else model_b
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        tokens.append(int(logits.argmax()))
        logps.append(float(torch.log_softmax(logits.float(), -1)[tokens[-1]]))
    return torch.tensor(tokens), torch.tensor(logps)


@torch.no_grad()
def test_weights_swapped_between_steps_continue_the_trajectory(tmp_path):
    """Partial rollouts: new weights loaded between two decode steps produce every later token (on the
    keys/values cached so far), and each token records the version that produced it."""
    model_a, model_b = tiny_model(seed=0), tiny_model(seed=1)
    model_a.save_pretrained(tmp_path)
    engine = NativeEngine(tmp_path, max_batch_size=8, max_seq_len=64)
    swap_at, new_tokens, calls = 4, 9, []

    def between_steps() -> int:  # call 1 admits (token 0); call t + 1 decodes token t
        calls.append(len(calls) + 1)
        if len(calls) == swap_at + 1:
            engine.update_weights((name, p.detach()) for name, p in model_b.named_parameters())
        return int(len(calls) > swap_at)

    batch = prompt_batch()
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                          between_steps=between_steps)
    expected = torch.tensor([0] * swap_at + [1] * (new_tokens - swap_at))
    for i, length in enumerate(LENGTHS):
        tokens, logps = _greedy_with_swap(model_a, model_b, batch["input_ids"][i, -length:], new_tokens, swap_at)
        assert torch.equal(out["responses"][i], tokens), i
        torch.testing.assert_close(out["rollout_log_probs"][i], logps, atol=1e-4, rtol=1e-4)
        assert torch.equal(out["token_weight_versions"][i], expected)
    # the swap changed the outcome: model_a alone continues differently
    assert not torch.equal(out["responses"], hf_greedy(model_a, batch, new_tokens))


# ---------------------------------------------------------------------------- the prefix cache


def _record_forwards(engine: NativeEngine) -> list[tuple[str, list[int]]]:
    """Spy on the engine's prompt computations: ("prefill", lengths) / ("extend", cached tokens per row)."""
    calls: list[tuple[str, list[int]]] = []
    prefill, extend = engine.decoder.prefill, engine.decoder.extend

    def spy_prefill(tokens, lengths, *rest):
        calls.append(("prefill", lengths.tolist()))
        return prefill(tokens, lengths, *rest)

    def spy_extend(tokens, starts, *rest):
        calls.append(("extend", starts.tolist()))
        return extend(tokens, starts, *rest)

    engine.decoder.prefill, engine.decoder.extend = spy_prefill, spy_extend
    return calls


def _continued(out: Batch, new: int, seed: int) -> Batch:
    """Each generated sequence of ``out`` (prompt + response, no padding inside) followed by ``new`` tokens."""
    extra = torch.randint(3, 90, (len(out), new), generator=torch.Generator().manual_seed(seed))
    return Batch({"input_ids": torch.cat([out["input_ids"], extra], 1),
                  "attention_mask": torch.cat([out["attention_mask"], torch.ones_like(extra)], 1)})


def _check_against_transformers(model, out: Batch, batch: Batch, new_tokens: int) -> None:
    assert torch.equal(out["responses"], hf_greedy(model, batch, new_tokens))
    ref = torch.log_softmax(forward_logits(model, out), -1).gather(-1, out["responses"][..., None])[..., 0]
    torch.testing.assert_close(out["rollout_log_probs"], ref, atol=1e-4, rtol=1e-4)


def test_a_prompt_that_continues_a_finished_sample_computes_only_its_new_tokens(tmp_path):
    """An endpoint agent's next call repeats the whole conversation: the slot that sampled the last turn
    still holds its keys/values, and only the tokens after them are computed. Other runs in between
    (whose free rows decode junk somewhere) leave the cached prefix intact; new weights drop it."""
    model, other = tiny_model(seed=0), tiny_model(seed=1)
    model.save_pretrained(tmp_path)
    engine = NativeEngine(tmp_path, CharTokenizer(), max_batch_size=4, max_seq_len=160)
    calls = _record_forwards(engine)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = engine.generate(prompt_batch([20, 24]), params)
    held = [20 + 20 - 1, 24 + 20 - 1]  # each prompt and every sampled token but the last, which was never fed
    assert sorted(len(t) for t in engine.cache.prefixes.values()) == held

    between = engine.generate(prompt_batch([6, 9], seed=3), params)  # takes the two slots that hold nothing
    _check_against_transformers(model, between, prompt_batch([6, 9], seed=3), 20)
    calls.clear()
    again = _continued(first, 5, seed=1)
    out = engine.generate(again, params)
    assert calls == [("extend", held)]
    _check_against_transformers(model, out, again, 20)

    engine.update_weights(other.named_parameters())
    calls.clear()
    more = _continued(out, 3, seed=2)
    out = engine.generate(more, params)
    assert [kind for kind, _ in calls] == ["prefill"]  # computed with the old weights: not used
    _check_against_transformers(other, out, more, 20)


def test_a_prompt_sharing_most_of_a_cached_prefix_copies_it_and_leaves_it_cached(tmp_path):
    model = tiny_model(seed=0)
    model.save_pretrained(tmp_path)
    engine = NativeEngine(tmp_path, CharTokenizer(), max_batch_size=4, max_seq_len=160)
    calls = _record_forwards(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = engine.generate(prompt_batch([30]), params)  # caches 30 + 11 tokens
    fork = Batch({"input_ids": torch.cat([first["input_ids"][:, :32], torch.tensor([[5, 6, 7, 8]])], 1)})
    fork["attention_mask"] = torch.ones_like(fork["input_ids"])
    calls.clear()
    out = engine.generate(fork, params)
    assert calls == [("extend", [32])]  # the shared 32 tokens were copied, not computed
    _check_against_transformers(model, out, fork, 12)
    calls.clear()
    again = _continued(first, 4, seed=1)
    out = engine.generate(again, params)
    assert calls == [("extend", [41])]  # the copy's source was kept: the first sample is still cached whole
    _check_against_transformers(model, out, again, 12)
    short = engine.generate(prompt_batch([5]), params)  # too short a shared prefix to be worth a call
    assert calls[-1] == ("prefill", [5])
    _check_against_transformers(model, short, prompt_batch([5]), 12)


def test_no_prefix_cache_for_a_model_passed_in():
    """The engine cannot see a passed-in model's weights change (an optimizer step), so it keeps nothing."""
    engine = NativeEngine(tiny_model(), max_batch_size=2, max_seq_len=64)
    engine.generate(prompt_batch([20]), SamplingParams(temperature=0, max_tokens=8))
    assert not engine.prefix_cache and engine.cache.prefixes == {}


@pytest.mark.parametrize("check_every", [1, 8])
def test_a_one_token_budget_runs_no_decode_step(check_every):
    """A sample that ends at its first token is freed at admission: the prefill's logits give that token
    (transformers' greedy one), and no decode step computes anything for nobody."""
    model = tiny_model()
    engine = NativeEngine(model, max_batch_size=4, max_seq_len=64, check_every=check_every)
    steps = []
    plain = engine.decode_step
    engine.decode_step = lambda *args: steps.append(args[2]) or plain(*args)
    batch = prompt_batch()
    out = engine.generate(batch, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    assert torch.equal(out["responses"], hf_greedy(model, batch, 1))
    assert out["finish_reason"] == ["length"] * len(batch) and steps == []
    mixed = prompt_batch()
    mixed["max_tokens"] = torch.tensor([1, 3] + [1] * (len(mixed) - 2))
    out = engine.generate(mixed, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert out["response_mask"].sum(1).tolist() == [1, 3] + [1] * (len(mixed) - 2)
    # the 3-token sample's two steps (over slots 0-1: it holds slot 1), or the steps until the host's next
    # look; the one-token samples add none
    assert steps == [2] * (2 if check_every == 1 else check_every)


def test_recorded_routes_are_the_experts_a_full_forward_routes_each_fed_token_to():
    """``record_routes``: response token t's experts (as the input of the step after it) equal those of one
    full-sequence forward, for every token a step fed; tokens no step fed (the last, padding) hold zeros."""
    from torchrlhf.models.moe import record_routing

    model = tiny_model("qwen3_moe")
    engine = NativeEngine(model, max_batch_size=3, max_seq_len=64, record_routes=True)
    out = engine.generate(prompt_batch(), SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1))
    routes, lengths = out["routed_experts"], out["response_mask"].sum(-1)
    assert routes.shape == (2 * len(LENGTHS), 8, 2, 2) and routes.dtype == torch.int16
    ids, mask = out["input_ids"].clone(), out["attention_mask"].clone()
    with torch.no_grad(), record_routing(model) as record:
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    prompt = out["prompts"].shape[1]
    full = torch.stack(record.experts, 1).view(ids.shape[0], ids.shape[1], 2, 2)[:, prompt:]
    fed = 0
    for i, n in enumerate(lengths.tolist()):
        got, want = routes[i, : n - 1].long().sort(-1).values, full[i, : n - 1].sort(-1).values
        assert torch.equal(got, want)
        assert (routes[i, n - 1:] == 0).all()
        fed += n - 1
    assert fed > 20


def test_record_routes_needs_a_moe_model_single_turn_and_the_eager_step():
    with pytest.raises(ValueError, match="no mixture-of-experts router"):
        NativeEngine(tiny_model("llama"), max_batch_size=2, max_seq_len=32, record_routes=True)
    with pytest.raises(ValueError, match="compile=False"):
        NativeEngine(tiny_model("qwen3_moe"), max_batch_size=2, max_seq_len=32, record_routes=True, compile=True)
