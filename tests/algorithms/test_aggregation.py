import pytest
import torch

from torchrlhf.algorithms import agg_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row: no valid token


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),  # (1 + 2 + 4) / 3
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 sequences with tokens
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 7 / 6),  # (3/3 + 4/3) / 2, constant normaliser T = 3
    ],
)
def test_modes_by_hand(mode, expected):
    torch.testing.assert_close(agg_loss(LOSS, MASK, mode), torch.tensor(expected))


def test_sum_norm_custom_scale_and_normalizer():
    # (3 + 4) / 10 / 2 = 0.35; with normalizer 4 sequences: (0.3 + 0.4) / 4
    out = agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10)
    torch.testing.assert_close(out, torch.tensor(0.35))
    torch.testing.assert_close(
        agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", loss_scale_factor=10, normalizer=4), torch.tensor(0.175)
    )


def test_empty_mask_is_zero_not_nan():
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert agg_loss(LOSS, torch.zeros(3, 3), mode) == 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_and_dp_accumulation_is_exact(mode):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, generator=g, requires_grad=True)
    mask = (torch.rand(8, 6, generator=g) > 0.5).float()
    mask[3] = 0
    full = agg_loss(x, mask, mode)
    (g_full,) = torch.autograd.grad(full, x)
    # global normaliser: valid tokens for token-mean, sequences with a valid token for seq-mean-*
    norm = mask.sum() if mode == "token-mean" else (mask.sum(-1) > 0).sum()
    # 2 "DP ranks" x 2 uneven micro-batches each; DP all-reduce of gradients is a SUM here
    pieces = [slice(0, 1), slice(1, 4), slice(4, 7), slice(7, 8)]
    total = sum(agg_loss(x[s], mask[s], mode, normalizer=norm, loss_scale_factor=6) for s in pieces)
    (g_micro,) = torch.autograd.grad(total, x)
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(g_micro, g_full)
    # per-micro-batch token means would not be exact (the reason for `normalizer`)
    if mode == "token-mean":
        naive = sum(agg_loss(x[s], mask[s], mode) for s in pieces) / len(pieces)
        assert not torch.allclose(naive, full)


def test_bf16():
    out = agg_loss(LOSS.bfloat16(), MASK.bfloat16(), "token-mean")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.tensor(7 / 3), rtol=1e-2, atol=1e-2)


def test_bad_mode_and_shape():
    with pytest.raises(ValueError, match="valid names: token-mean"):
        agg_loss(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(LOSS, MASK[:, :2], "token-mean")
