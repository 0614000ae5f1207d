"""CriticWorker numerics against a direct forward of the value model and a hand-written clipped value loss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_helpers import rollout_batch, grouped  # noqa: E402

from torchrlhf.models import load_value_model, save_tiny_model  # noqa: E402
from torchrlhf.workers.critic import CriticWorker  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_from=None, vocab_size=128))


def direct_values(model_dir: str, batch, seed: int = 0):
    """Per-token values of a plain full-sequence forward at the positions that predict each response token."""
    model = load_value_model(model_dir, seed=seed)
    r = batch["responses"].shape[1]
    out = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    return model, out[:, -r - 1 : -1]


@pytest.mark.parametrize("dynamic", [False, True])
def test_compute_values_matches_direct_forward(model_dir, dynamic):
    batch = rollout_batch(5)
    critic = CriticWorker(model_dir, **grouped(ppo_mini_batch_size=2, ppo_micro_batch_size_per_device=2, use_dynamic_bsz=dynamic,
                          max_tokens_per_micro_batch=14))
    values = critic.compute_values(batch)["values"]
    _, want = direct_values(model_dir, batch)
    torch.testing.assert_close(values, want.detach() * batch["response_mask"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("micro_kw", [dict(ppo_micro_batch_size_per_device=1),
                                      dict(use_dynamic_bsz=True, max_tokens_per_micro_batch=15)])
def test_gradient_matches_hand_derived_value_loss(model_dir, micro_kw):
    batch = rollout_batch(6, seed=4)
    model, vpreds = direct_values(model_dir, batch)
    mask = batch["response_mask"].float()
    batch["values"] = (vpreds.detach() + torch.linspace(-1, 1, vpreds.numel()).view_as(vpreds)) * mask
    # clamp vpreds itself (not values + clamped delta): an unclipped token must give exactly vpreds, else
    # rounding makes (clipped - R)^2 > (v - R)^2 by an ulp and counts as clipped.
    clipped = torch.minimum(torch.maximum(vpreds, batch["values"] - 0.5), batch["values"] + 0.5)
    per_token = torch.maximum((vpreds - batch["returns"]) ** 2, (clipped - batch["returns"]) ** 2)
    loss = 0.5 * (per_token * mask).sum() / mask.sum()
    loss.backward()
    clipfrac = (((clipped - batch["returns"]) ** 2 > (vpreds - batch["returns"]) ** 2).float() * mask).sum() / mask.sum()

    critic = CriticWorker(model_dir, **grouped(ppo_mini_batch_size=6, rollout_n=1, cliprange_value=0.5, **micro_kw))
    stats = critic._train_mini_batch(batch, {})
    assert stats["critic/vf_loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert stats["critic/vf_clipfrac"] == pytest.approx(clipfrac.item(), abs=1e-6)
    assert stats["critic/vpred_mean"] == pytest.approx(((vpreds * mask).sum() / mask.sum()).item(), rel=1e-5)
    ref = dict(model.named_parameters())
    for name, p in critic.model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_update_reports_metrics_and_trains(model_dir):
    critic = CriticWorker(model_dir, **grouped(lr=1e-3, ppo_mini_batch_size=2, rollout_n=2, ppo_micro_batch_size_per_device=2))
    batch = rollout_batch(8)
    first = critic.update(batch)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm", "critic/vpred_mean", "critic/lr"):
        assert key in first
    for _ in range(5):
        last = critic.update(batch)
    assert last["critic/vf_loss"] < first["critic/vf_loss"]
