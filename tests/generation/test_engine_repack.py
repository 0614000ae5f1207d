"""Repack (Laminar) in the native engine: a call hands back its unfinished samples when few slots still decode,
and another engine continues them token for token."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams
from torchrlhf.generation.base import CARRIED, carried_samples, concat_generations, continuations

from gen_helpers import left_padded, tiny_model

SHORT, LONG = 3, 20


def _prompts() -> Batch:
    """Two prompts with 4 samples each: the first prompt's samples end after SHORT tokens, the second's run to LONG."""
    ids, mask = left_padded([6, 4], seed=3)
    return Batch({"input_ids": ids, "attention_mask": mask, "max_tokens": torch.tensor([SHORT, LONG]),
                  "seed": torch.tensor([11, 12])})


SAMPLING = SamplingParams(n=4, temperature=1.0, max_tokens=LONG, ignore_eos=True)


@pytest.fixture
def model_dir(tmp_path):
    tiny_model(seed=0).save_pretrained(tmp_path)
    return tmp_path


@torch.no_grad()
def test_released_samples_continue_token_for_token_on_another_engine(model_dir):
    """Engine A releases when 4 of its 8 slots still decode (below 0.75 x 8); engine B continues the carried
    samples from a re-prefill. Tokens equal an uninterrupted generation; log-probs within prefill-vs-decode
    rounding; the carried tokens keep exactly the log-probs they were sampled with."""
    reference = NativeEngine(model_dir, max_batch_size=8, max_seq_len=64).generate(_prompts(), SAMPLING)
    a = NativeEngine(model_dir, max_batch_size=8, max_seq_len=64)
    first = a.generate(_prompts(), SAMPLING, release_below=0.75)
    assert first["finish_reason"] == ["length"] * 4 + [CARRIED] * 4
    carried_len = first["response_mask"][4:].sum(-1)
    assert bool((carried_len >= SHORT).all()) and bool((carried_len < LONG).all())
    # the decode steps ran 8 slots until the short samples ended, then the call stopped
    assert first.meta["rollout/slot_steps"] == 8 * (SHORT - 1) + 4 * (int(carried_len[0]) - SHORT)

    rows, cont = continuations(_prompts(), first, SAMPLING.n)
    assert rows == [4, 5, 6, 7]
    assert cont["sample_index"].tolist() == [0, 1, 2, 3] and cont["seed"].tolist() == [12] * 4
    b = NativeEngine(model_dir, max_batch_size=8, max_seq_len=64)
    second = b.generate(cont, SamplingParams(n=1, temperature=1.0, max_tokens=LONG, ignore_eos=True))
    assert not any(k.startswith("carried_") for k in second.keys())

    assert torch.equal(second["responses"], reference["responses"][4:])
    assert torch.equal(second["input_ids"], reference["input_ids"][4:])
    assert second["finish_reason"] == ["length"] * 4
    torch.testing.assert_close(second["rollout_log_probs"], reference["rollout_log_probs"][4:], atol=1e-5, rtol=1e-5)
    for r in range(4):
        t = int(carried_len[r])
        assert torch.equal(second["rollout_log_probs"][r, :t], first["rollout_log_probs"][4 + r, :t])
    assert torch.equal(first["responses"][:4], reference["responses"][:4])
    merged = concat_generations([first[:4], second], 0)
    assert torch.equal(merged["responses"], reference["responses"])


@torch.no_grad()
def test_no_release_without_the_threshold_or_before_the_slots_filled(model_dir):
    """Without ``release_below`` the call runs to the end; a call that never fills the threshold (2 samples
    against 0.5 x 8 slots) never releases, although it decodes below it throughout."""
    engine = NativeEngine(model_dir, max_batch_size=8, max_seq_len=64)
    assert CARRIED not in engine.generate(_prompts(), SAMPLING)["finish_reason"]
    small = engine.generate(_prompts(), SamplingParams(n=1, temperature=1.0, max_tokens=LONG, ignore_eos=True),
                            release_below=0.5)
    assert small["finish_reason"] == ["length", "length"]
    assert small["response_mask"].sum(-1).tolist() == [SHORT, LONG]


def test_carried_columns_are_checked():
    ids, mask = left_padded([4], seed=1)
    base = {"input_ids": ids, "attention_mask": mask, "carried_tokens": torch.ones(1, 8, dtype=torch.long),
            "carried_log_probs": torch.zeros(1, 8), "carried_versions": torch.zeros(1, 8, dtype=torch.long),
            "sample_index": torch.tensor([0])}
    with pytest.raises(ValueError, match="carried_lengths"):
        carried_samples(Batch(dict(base)), SamplingParams(n=1, max_tokens=8))
    full = Batch({**base, "carried_lengths": torch.tensor([8])})
    with pytest.raises(ValueError, match="needs 1 .. 7"):
        carried_samples(full, SamplingParams(n=1, max_tokens=8))
    with pytest.raises(ValueError, match="n must be 1"):
        carried_samples(full, SamplingParams(n=2, max_tokens=8))


@torch.no_grad()
def test_carried_samples_join_a_running_call(model_dir):
    """A long-tail call starts with one carried sample; the other three arrive while it runs (one at its
    first free-slot look, two at its last look, when it would end). All four continue token for token, and
    come back in the order they joined."""
    reference = NativeEngine(model_dir, max_batch_size=8, max_seq_len=64).generate(_prompts(), SAMPLING)
    first = NativeEngine(model_dir, max_batch_size=8, max_seq_len=64).generate(_prompts(), SAMPLING, release_below=0.75)
    _, cont = continuations(_prompts(), first, SAMPLING.n)
    cont["tag"] = torch.tensor([10, 11, 12, 13])  # a column of the caller's comes back with each sample
    arrivals, asked = [cont[1:2], None, None], []

    def more(final: bool):
        asked.append(final)
        if final and len(asked) > 1 and not any(asked[:-1]):
            return cont[2:4]  # they arrive just as the call would end
        return arrivals.pop(0) if arrivals and not final else None

    engine = NativeEngine(model_dir, max_batch_size=8, max_seq_len=64)
    out = engine.generate(cont[0:1], SamplingParams(n=1, temperature=1.0, max_tokens=LONG, ignore_eos=True),
                          more_carried=more)
    assert out["tag"].tolist() == [10, 11, 12, 13]
    assert torch.equal(out["responses"], reference["responses"][4:])
    torch.testing.assert_close(out["rollout_log_probs"], reference["rollout_log_probs"][4:], atol=1e-5, rtol=1e-5)
    assert asked.count(True) == 2  # the call asked again after the late arrivals ended
    with pytest.raises(ValueError, match="more_carried joins a call of carried samples"):
        engine.generate(_prompts(), SAMPLING, more_carried=more)
