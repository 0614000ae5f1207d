"""The planner's extrapolated micro-batch memory against a direct trace of the whole model (`trace_micro_batch`; a
trained role's beside its mini-batch's gradients, as the planner counts it)."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.models.loading import save_tiny_model
from torchrlhf.plan.memory import micro_batch_memory, shallow_depths
from torchrlhf.trainer.memory import trace_micro_batch


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


def test_a_deep_model_extrapolates_from_two_shallow_depths(deep_model_dir):
    common = dict(prompt_len=24, response_len=8, dtype=torch.float32, optim={"lr": 1e-6})
    direct = trace_micro_batch(deep_model_dir, micro=3, train=True, accumulating=True, **common)
    estimate = micro_batch_memory(deep_model_dir, kind="train", micro=3, depths=(3, 6), layers=12, **common)
    assert sum(estimate.values()) == pytest.approx(sum(direct.values()), rel=0.03)
    assert estimate["parameters"] == pytest.approx(direct["parameters"], rel=1e-6)


def test_shallow_depths_keep_the_blocks_heavier_than_the_rest():
    # 80 layers of 10 M block weights, 40 M elsewhere: 4 x 40 / 10 = 16 layers, then 32
    assert shallow_depths(80, 80 * 10_000_000, 40_000_000) == (16, 32)
    assert shallow_depths(30, 30 * 3_500_000, 28_000_000) is None  # SmolLM2: its embedding outweighs 32 layers


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
