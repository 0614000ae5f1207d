import pytest
import torch
from transformers import LlamaForSequenceClassification, LlamaModel

from torchrlhf.models import ValueModel, load_value_model, score_at_last_token, tiny_llama_config


def test_score_at_last_token_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 0]])  # right-padded, left-padded, single token
    torch.testing.assert_close(score_at_last_token(values, mask), torch.tensor([3.0, 8.0, 10.0]))


def test_score_at_last_token_rejects_bad_input():
    with pytest.raises(ValueError, match="no valid token"):
        score_at_last_token(torch.zeros(2, 3), torch.tensor([[1, 1, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="differ"):
        score_at_last_token(torch.zeros(2, 3), torch.ones(2, 4))


def test_value_model_from_causal_lm_dir(tiny_dir):
    model = load_value_model(tiny_dir, init_head_std=0.5, seed=1)
    assert model.score.weight.shape == (1, 64)
    assert torch.all(model.score.bias == 0)
    assert 0.3 < model.score.weight.std().item() < 0.7
    ids = torch.randint(0, 256, (3, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    values = model(ids, mask, pos)
    assert values.shape == (3, 6)
    # Hand computation: the backbone's final hidden states dotted with the head weight.
    backbone = LlamaModel.from_pretrained(tiny_dir, attn_implementation="sdpa")
    hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    expected = hidden @ model.score.weight[0] + model.score.bias[0]
    torch.testing.assert_close(values, expected)
    rewards = score_at_last_token(values, mask)
    torch.testing.assert_close(rewards, expected[:, -1])


def test_value_model_from_sequence_classification_checkpoint(tmp_path):
    cfg = tiny_llama_config(vocab_size=256, num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(cfg)
    rm.save_pretrained(tmp_path)
    model = load_value_model(tmp_path)
    torch.testing.assert_close(model.score.weight, rm.score.weight, rtol=0, atol=0)
    ids = torch.randint(1, 256, (2, 5))
    ids[1, 3:] = 0  # right padding with pad id 0
    mask = (ids != 0).long()
    # HF's own reward: logits at the last non-pad token.
    hf_reward = rm(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    ours = score_at_last_token(model(ids, mask, None), mask)
    torch.testing.assert_close(ours, hf_reward)


def test_multi_label_head_is_rejected(tmp_path):
    cfg = tiny_llama_config(vocab_size=256, num_labels=2, pad_token_id=0)
    LlamaForSequenceClassification(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=1"):
        load_value_model(tmp_path)


def test_value_model_trains(tiny_dir):
    model = load_value_model(tiny_dir)
    ids = torch.randint(0, 256, (2, 5))
    values = model(ids)
    assert values.shape == (2, 5) and values._base is None  # not a view: FSDP2 warns when its root returns one
    loss = values.pow(2).mean()
    loss.backward()
    assert model.score.weight.grad is not None
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert isinstance(model, ValueModel)
