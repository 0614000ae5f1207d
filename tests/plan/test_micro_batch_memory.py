"""The planner's extrapolated micro-batch memory against a direct trace of the whole model (`trace_micro_batch`; a
trained role's beside its mini-batch's gradients, as the planner counts it)."""

from __future__ import annotations

import json
import multiprocessing.forkserver
from pathlib import Path

import pytest
import torch

from torchrlhf.models.loading import save_tiny_model
from torchrlhf.plan import memory
from torchrlhf.plan.memory import (SHALLOW_DEPTHS, _at_depth, dense_traces, micro_batch_memory, shallow_depths,
                                   traced_ahead)
from torchrlhf.plan.trace_cache import ENV
from torchrlhf.trainer.memory import trace_micro_batch, trace_shared_prefix_update


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory) -> str:
    # blocks outweigh the embedding (vocabulary 256), so a shallow copy's peak falls where the whole model's does
    return str(save_tiny_model(tmp_path_factory.mktemp("deep"), tokenizer_from=None, vocab_size=256, hidden_size=64,
                               intermediate_size=256, num_hidden_layers=12))


@pytest.mark.parametrize("kind", ["train", "value", "forward", "value_forward"])
def test_rows_extrapolate_to_a_direct_trace(deep_model_dir, kind):
    common = dict(prompt_len=24, response_len=8, dtype=torch.float32, optim={"lr": 1e-6})
    train = kind in ("train", "value")
    direct = trace_micro_batch(deep_model_dir, micro=5, train=train, accumulating=train,
                               value_head=kind.startswith("value"), **common)
    estimate = micro_batch_memory(deep_model_dir, kind=kind, micro=5, **common)
    assert sum(estimate.values()) == pytest.approx(sum(direct.values()), rel=0.02)
    for k in ("parameters", "optimizer states"):
        assert estimate.get(k, 0.0) == pytest.approx(direct.get(k, 0.0), rel=1e-6)


def test_a_no_grad_pass_holds_less_than_an_update_and_an_unknown_kind_is_refused(deep_model_dir):
    common = dict(micro=8, prompt_len=24, response_len=8, dtype=torch.float32, optim={"lr": 1e-6})
    update = micro_batch_memory(deep_model_dir, kind="train", **common)
    no_grad = micro_batch_memory(deep_model_dir, kind="forward", **common)
    working = [sum(v for k, v in f.items() if k not in ("parameters", "gradients", "optimizer states"))
               for f in (update, no_grad)]
    assert working[1] < working[0] / 2  # no activations kept for backward
    with pytest.raises(ValueError, match="kind must be one of"):
        micro_batch_memory(deep_model_dir, kind="values", **common)


def test_a_deep_model_is_deepened_from_two_shallow_depths(deep_model_dir):
    common = dict(prompt_len=24, response_len=8, dtype=torch.float32, optim={"lr": 1e-6})
    direct = trace_micro_batch(deep_model_dir, micro=3, train=True, accumulating=True, **common)
    estimate = micro_batch_memory(deep_model_dir, kind="train", micro=3, depths=SHALLOW_DEPTHS, layers=12, **common)
    assert sum(estimate.values()) == pytest.approx(sum(direct.values()), rel=1e-9)  # the blocks set its peak
    assert estimate["parameters"] == pytest.approx(direct["parameters"], rel=1e-9)
    assert estimate["optimizer states"] == pytest.approx(direct["optimizer states"], rel=1e-9)


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory) -> str:
    # SmolLM2's vocabulary on 12 tiny layers: the embedding and the head outweigh the blocks
    return str(save_tiny_model(tmp_path_factory.mktemp("wide"), tokenizer_from=None, vocab_size=49152, hidden_size=64,
                               intermediate_size=256, num_hidden_layers=12))


@pytest.mark.parametrize("kind, shared", [("train", None), ("forward", None), ("forward", (3, 2))])
def test_deepening_never_falls_short_where_the_embedding_sets_a_shallow_peak(wide_vocab_dir, kind, shared):
    """A line through the peaks at 2 and 4 layers falls short of the 12-layer trace with activation checkpointing
    (0.97x: the head's temporaries set the shallow peaks, the checkpointed inputs the deep one); the deepened
    estimate is at least the direct trace and within 3 % of it in every pass."""
    common = dict(prompt_len=256, response_len=8, dtype=torch.float32, optim={"lr": 1e-6}, micro=8,
                  activation_checkpointing=True)
    train = kind == "train"
    if shared is None:
        direct = trace_micro_batch(wide_vocab_dir, train=train, accumulating=train, **common)
    else:
        direct = trace_shared_prefix_update(wide_vocab_dir, train=train, prompts=shared[0], n=shared[1], **common)
        direct.pop("offloaded")
    estimate = micro_batch_memory(wide_vocab_dir, kind=kind, depths=SHALLOW_DEPTHS, layers=12, shared=shared,
                                  exact=True, **common)
    assert sum(direct.values()) <= sum(estimate.values()) <= 1.03 * sum(direct.values())
    if kind == "train":
        a, b = (sum(trace_micro_batch(_at_depth(wide_vocab_dir, d), train=True, accumulating=True,
                                      **common).values()) for d in SHALLOW_DEPTHS)
        line = b + (12 - SHALLOW_DEPTHS[1]) * (b - a) / (SHALLOW_DEPTHS[1] - SHALLOW_DEPTHS[0])
        assert line < 0.98 * sum(direct.values())  # the premise: the peaks' line alone falls short


def test_shallow_depths_only_for_a_deeper_model_of_alike_layers(tmp_path):
    def config(**kw) -> str:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps(kw))
        return str(d)

    assert shallow_depths(config(), 24) == SHALLOW_DEPTHS
    assert shallow_depths(config(), SHALLOW_DEPTHS[1]) is None
    assert shallow_depths(config(layer_types=["full_attention"] * 24), 24) == SHALLOW_DEPTHS
    assert shallow_depths(config(layer_types=["sliding_attention", "full_attention"] * 12), 24) is None
    assert shallow_depths(config(num_experts=8, mlp_only_layers=[0]), 24) is None
    assert shallow_depths(config(num_experts=8, decoder_sparse_step=2), 24) is None
    assert shallow_depths(config(num_experts=8, decoder_sparse_step=1), 24) == SHALLOW_DEPTHS


def test_a_peak_flat_over_few_rows_still_grows_with_many(tmp_path):
    """SmolLM2's vocabulary on two tiny layers, 256-token prompts: one moment with few activations alive (the
    embedding's gradient being built) sets the peak of 1 to 4 rows, so 2 and 4 rows trace alike and a line through
    them stays flat; 16 rows' activations outweigh it. The estimate is the direct trace at 16 rows and at least the
    direct trace at 12."""
    model = str(save_tiny_model(tmp_path / "wide", tokenizer_from="smollm2"))
    common = dict(prompt_len=256, response_len=4, dtype=torch.float32, optim={"lr": 1e-6})

    direct = {rows: sum(trace_micro_batch(model, micro=rows, train=True, accumulating=True, **common).values())
              for rows in (2, 4, 12, 16)}

    def estimate(rows: int) -> float:
        return sum(micro_batch_memory(model, kind="train", micro=rows, **common).values())

    assert direct[2] == direct[4] and direct[16] > 1.2 * direct[4]  # the premise: flat, then rising
    assert estimate(16) == pytest.approx(direct[16], rel=1e-9)
    assert direct[12] <= estimate(12) <= direct[16]


def test_a_no_grad_pass_over_many_prompts_is_deepened_above_its_direct_trace():
    """Llama-2 7B's shape (`tools/bench/shapes`), the actor's old-log-prob pass with shared prefixes over 256 prompts
    of 1 024 tokens, suffix micro-batches of 64, GPU tiles: one moment sets the peak at 2, 4 and 8 layers and a
    steeper one at 32, so the line through the largest moments of two shallow traces gave 0.98x of the direct trace.
    Each moment's own growth is followed now."""
    model = str(Path(__file__).resolve().parents[2] / "tools" / "bench" / "shapes" / "llama2-7b")
    common = dict(prompt_len=1024, response_len=1024, dtype=torch.bfloat16, device_type="cuda")
    direct = trace_shared_prefix_update(model, prompts=256, n=1, micro=64, train=False, **common)
    direct.pop("offloaded")
    estimate = micro_batch_memory(model, kind="forward", micro=64, shared=(256, 1), exact=True,
                                  depths=SHALLOW_DEPTHS, layers=32, **common)
    assert sum(direct.values()) <= sum(estimate.values()) <= 1.1 * sum(direct.values())


def test_traces_taken_ahead_by_another_process_are_read_back_as_the_search_would_trace_them(deep_model_dir, tmp_path,
                                                                                            monkeypatch):
    """`traced_ahead` traces the powers of two up to the one above the rows asked for (the chord's ends), in a
    process of its own, into the disk cache; the search then reads them there: with the tracer made to fail, a
    5-row estimate (the chord of 4 and 8 rows) equals one traced here with no cache at all. The tracer forks from
    a server started before the cache was chosen (as in a notebook that planned before): it writes where the
    planner reads all the same."""
    multiprocessing.forkserver.ensure_running()
    kw = dict(prompt_len=24, response_len=8, dtype=torch.float32, optim={"lr": 1e-6})
    monkeypatch.setenv(ENV, "")
    want = micro_batch_memory(deep_model_dir, kind="train", micro=5, **kw)
    traces = dense_traces(deep_model_dir, ("train",), 5, **kw)
    assert [t[-1] for t in traces] == [1, 2, 4, 8]
    with traced_ahead(traces) as process:
        assert process is None  # no disk cache: nothing runs
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    memory._dense.cache_clear()
    memory._estimate.cache_clear()
    with traced_ahead(traces) as process:
        process.join(timeout=600)
    assert process.exitcode == 0

    def no_trace(*args, **kwargs):
        raise AssertionError("traced again: the cache should hold it")

    monkeypatch.setattr(memory, "trace_micro_batch", no_trace)
    assert micro_batch_memory(deep_model_dir, kind="train", micro=5, **kw) == pytest.approx(want)
