"""RewardModelWorker: the score is the head's output at each sequence's last valid token."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from dist_helpers import rollout_batch  # noqa: E402

from torchrlhf.models import load_value_model, save_tiny_model  # noqa: E402
from torchrlhf.workers.reward_model import RewardModelWorker  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_from=None, vocab_size=128))


@pytest.mark.parametrize("dynamic", [False, True])
def test_scores_at_last_valid_token(model_dir, dynamic):
    batch = rollout_batch(5, seed=2)
    rm = RewardModelWorker(model_dir, output_key="cost_scores", micro_batch_size_per_device=2,
                           use_dynamic_bsz=dynamic, max_tokens_per_micro_batch=14, seed=7)
    out = rm.compute_scores(batch)
    assert out.keys() == ["cost_scores"] and out["cost_scores"].shape == (5,)
    model = load_value_model(model_dir, seed=7)
    with torch.no_grad():
        per_token = model(batch["input_ids"], batch["attention_mask"], batch["position_ids"])
    prompt_len = batch["prompts"].shape[1]
    last = prompt_len + batch["response_mask"].sum(-1) - 1  # responses are right-padded
    want = per_token[torch.arange(5), last]
    torch.testing.assert_close(out["cost_scores"], want, atol=1e-5, rtol=1e-5)
