import torch

from torchrlhf.algorithms import compute_value_loss


def test_clipped_value_loss_by_hand():
    # old values 1, clip 0.5 -> clipped preds lie in [0.5, 1.5]
    # t0: v=2,   R=3:   l1 = 1,    clipped 1.5 -> l2 = 2.25 -> 2.25 (clipfrac, no grad through the clamp)
    # t1: v=1.2, R=0:   l1 = 1.44, clipped 1.2 -> l2 = 1.44 -> 1.44
    # t2: v=0,   R=1.2: l1 = 1.44, clipped 0.5 -> l2 = 0.49 -> 1.44
    # t3: masked
    # loss = 0.5 * (2.25 + 1.44 + 1.44) / 3 = 0.855; vf_clipfrac = 1/3
    vpreds = torch.tensor([[2.0, 1.2, 0.0, 9.0]], requires_grad=True)
    values = torch.ones(1, 4)
    returns = torch.tensor([[3.0, 0.0, 1.2, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clipfrac = compute_value_loss(vpreds, values, returns, mask, cliprange_value=0.5)
    torch.testing.assert_close(loss, torch.tensor(0.855))
    torch.testing.assert_close(clipfrac, torch.tensor(1 / 3))
    loss.backward()
    # d/dv 0.5 * (v - R)^2 / 3 = (v - R) / 3 on unclipped-branch tokens; clamped branch -> 0
    torch.testing.assert_close(vpreds.grad, torch.tensor([[0.0, 0.4, -0.4, 0.0]]))


def test_value_loss_without_clip_and_seq_mode():
    vpreds = torch.tensor([[2.0, 0.0], [1.0, 5.0]])
    returns = torch.tensor([[0.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    # squared errors [[4, 0], [1, -]]: token-mean 0.5 * 5/3; seq-mean-token-mean 0.5 * (2 + 1)/2
    loss, frac = compute_value_loss(vpreds, vpreds, returns, mask, cliprange_value=None)
    torch.testing.assert_close(loss, torch.tensor(5 / 6))
    assert frac == 0
    loss, _ = compute_value_loss(
        vpreds, vpreds, returns, mask, cliprange_value=None, loss_agg_mode="seq-mean-token-mean"
    )
    torch.testing.assert_close(loss, torch.tensor(0.75))
