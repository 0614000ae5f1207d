import math

import pytest
import torch

from torchrlhf.algorithms import POLICY_LOSSES, compute_policy_loss


def _ppo_inputs():
    # token: (A, ratio)  -> l1 = -A r, l2 = -A clip(r, 0.8, 1.2), l3 = -A * 3
    # 0: ( 1, 1.5)  l1 -1.5, l2 -1.2 -> max -1.2 (clipped, no grad)
    # 1: ( 1, 0.5)  l1 -0.5, l2 -0.8 -> max -0.5 (grad -A r / 4 = -0.125)
    # 2: (-1, 5.0)  l1  5.0, l2  1.2 -> max 5.0, dual clip min(5, 3) = 3 (lower clip, no grad)
    # 3: (-1, 0.5)  l1  0.5, l2  0.8 -> max 0.8 (clipped, no grad)
    # 4: masked (A=100, ratio 10)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 100.0]])
    ratio = torch.tensor([[1.5, 0.5, 5.0, 0.5, 10.0]])
    old = torch.tensor([[-1.0, -2.0, -3.0, -1.5, -0.5]])
    log_prob = (old + ratio.log()).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
    return old, log_prob, adv, mask, ratio


def test_ppo_by_hand():
    old, log_prob, adv, mask, ratio = _ppo_inputs()
    loss, m = compute_policy_loss("ppo", old, log_prob, adv, mask)
    # (-1.2 - 0.5 + 3 + 0.8) / 4 = 0.525
    torch.testing.assert_close(loss, torch.tensor(0.525))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.5))  # tokens 0 and 3
    torch.testing.assert_close(m["pg_clipfrac_lower"], torch.tensor(0.25))  # token 2
    ppo_kl = -(math.log(1.5) + math.log(0.5) + math.log(5.0) + math.log(0.5)) / 4
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(ppo_kl))
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.125, 0.0, 0.0, 0.0]]))


def test_ppo_asymmetric_clip_higher():
    # A=1, ratio 1.25: clip_high 0.28 -> unclipped -1.25; clip_high 0.2 -> clipped -1.2
    old = torch.zeros(1, 1)
    lp = torch.full((1, 1), math.log(1.25))
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    loss, m = compute_policy_loss("ppo", old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    torch.testing.assert_close(loss, torch.tensor(-1.25))
    assert m["pg_clipfrac"] == 0
    loss, m = compute_policy_loss("ppo", old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    torch.testing.assert_close(loss, torch.tensor(-1.2))
    assert m["pg_clipfrac"] == 1
    # A=-1, ratio 0.75: low 0.2 -> clip to 0.8 -> loss 0.8; low 0.3 -> unclipped 0.75
    lp = torch.full((1, 1), math.log(0.75))
    loss, _ = compute_policy_loss("ppo", old, lp, -adv, mask, clip_ratio_low=0.3, clip_ratio_high=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.75))


def test_ppo_log_ratio_clamped():
    # log ratio 50 is clamped to 20: with A=-1 the dual clip gives 3; ppo_kl = -20
    old, lp, mask = torch.zeros(1, 2), torch.tensor([[50.0, 50.0]]), torch.ones(1, 2)
    loss, m = compute_policy_loss("ppo", old, lp, torch.tensor([[-1.0, 1.0]]), mask)
    torch.testing.assert_close(loss, torch.tensor((3.0 - 1.2) / 2))
    torch.testing.assert_close(m["ppo_kl"], torch.tensor(-20.0))


def test_ppo_rejects_bad_clip_ratio_c():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        compute_policy_loss("ppo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                            clip_ratio_c=1.0)


def test_tis_weights_multiply_and_stop_gradient():
    # reinforce with A=1, log pi = [-1, -2], w = [0.5, 2]: (0.5*1 + 2*2) / 2 = 2.25; d/dlogpi = -A w / 2
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    w = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss, _ = compute_policy_loss("reinforce", lp.detach(), lp, torch.ones(1, 2), torch.ones(1, 2), tis_weights=w)
    torch.testing.assert_close(loss, torch.tensor(2.25))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -1.0]]))
    assert w.grad is None


def test_gspo_sequence_ratio_and_stop_gradient():
    # seq 0: log-ratios [0.1, 0.3] (+ masked 5.0) -> mean 0.2, s0 = e^0.2 = 1.221403, A=-1:
    #        l1 = 1.221403, l2 = clip -> 1.2 -> max 1.221403 (unclipped); grad per token = -A * s0 / N
    # seq 1: log-ratio [-0.5] -> s1 = e^-0.5 = 0.606531, A=-2: l1 = 1.213061, l2 = 2*0.8 = 1.6 -> 1.6 (clipped, no grad)
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], requires_grad=True)
    delta = torch.tensor([[0.1, 0.3, 5.0], [-0.5, 0.0, 0.0]])
    lp = (old.detach() + delta).requires_grad_()
    adv = torch.tensor([[-1.0] * 3, [-2.0] * 3])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    s0 = math.exp(0.2)
    loss, m = compute_policy_loss("gspo", old, lp, adv, mask)
    torch.testing.assert_close(loss, torch.tensor((2 * s0 + 1.6) / 3))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(1 / 3))
    loss.backward()
    # Token-level trick: gradient is sg[s_i] * grad log pi (not the derivative through s_i, which would add
    # sum_t' s0/2 terms); the sequence ratio is a stop-gradient, so old_log_prob receives no gradient.
    torch.testing.assert_close(lp.grad, torch.tensor([[s0 / 3, s0 / 3, 0.0], [0.0, 0.0, 0.0]]))
    assert old.grad is None
    loss_sm, _ = compute_policy_loss("gspo", old, lp, adv, mask, loss_agg_mode="seq-mean-token-mean")
    torch.testing.assert_close(loss_sm, torch.tensor((s0 + 1.6) / 2))


def test_cispo_clipped_weight_is_stop_gradient():
    # token 0: ratio 1.5 -> weight 1.2, A=1, logpi=-0.5: loss -1*1.2*(-0.5) = 0.6, d/dlogpi = -1.2
    # token 1: ratio 0.9 -> weight 0.9, A=-2, logpi=-1: loss 2*0.9*(-1) = -1.8, d/dlogpi = 1.8
    # token-mean over 2: -0.6; grads /2. Unlike PPO the clipped token still gets a gradient.
    lp = torch.tensor([[-0.5, -1.0]], requires_grad=True)
    old = (lp.detach() - torch.tensor([[math.log(1.5), math.log(0.9)]])).requires_grad_()
    loss, m = compute_policy_loss("cispo", old, lp, torch.tensor([[1.0, -2.0]]), torch.ones(1, 2))
    torch.testing.assert_close(loss, torch.tensor(-0.6))
    torch.testing.assert_close(m["pg_clipfrac"], torch.tensor(0.5))
    torch.testing.assert_close(m["pg_clipfrac_lower"], torch.tensor(0.0))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.6, 0.9]]))
    assert old.grad is None


def test_reinforce_by_hand():
    # -A logpi: -(1)(-0.5) = 0.5, -(-2)(-1) = -2 -> mean -0.75; grad = -A/2 = [-0.5, 1]
    lp = torch.tensor([[-0.5, -1.0, -7.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, m = compute_policy_loss("reinforce", lp.detach(), lp, torch.tensor([[1.0, -2.0, 3.0]]), mask)
    torch.testing.assert_close(loss, torch.tensor(-0.75))
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5, 1.0, 0.0]]))
    assert set(m) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}


@pytest.mark.parametrize("name", ["ppo", "gspo", "cispo", "reinforce"])
def test_bf16_and_metrics_keys(name):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 4, generator=g)
    lp = (old + 0.1 * torch.randn(3, 4, generator=g)).bfloat16().requires_grad_()
    adv = torch.randn(3, 4, generator=g).bfloat16()
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1.0]]).bfloat16()
    loss, m = compute_policy_loss(name, old.bfloat16(), lp, adv, mask)
    loss32, _ = compute_policy_loss(name, old, lp.detach().float(), adv.float(), mask.float())
    assert torch.isfinite(loss) and set(m) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
    torch.testing.assert_close(loss.float(), loss32, rtol=3e-2, atol=3e-2)
    loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad.float()).all()
    assert (lp.grad[mask == 0] == 0).all()


def test_micro_batches_sum_to_full_batch():
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(6, 5, generator=g)
    lp_full = (old + 0.3 * torch.randn(6, 5, generator=g)).requires_grad_()
    adv = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.4).float()
    full, _ = compute_policy_loss("ppo", old, lp_full, adv, mask)
    full.backward()
    lp_micro = lp_full.detach().clone().requires_grad_()
    total = sum(
        compute_policy_loss("ppo", old[s], lp_micro[s], adv[s], mask[s], normalizer=mask.sum())[0]
        for s in (slice(0, 2), slice(2, 5), slice(5, 6))
    )
    total.backward()
    torch.testing.assert_close(total, full)
    torch.testing.assert_close(lp_micro.grad, lp_full.grad)


def test_unknown_policy_loss_lists_valid_names():
    with pytest.raises(ValueError, match="unknown policy loss 'ppo2'") as err:
        compute_policy_loss("ppo2", torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    for name in ("ppo", "gspo", "cispo", "reinforce"):
        assert name in str(err.value) and name in POLICY_LOSSES


def test_shape_mismatch_named():
    with pytest.raises(ValueError, match="advantages"):
        compute_policy_loss("ppo", torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
