import math

import pytest
import torch

from torchrlhf.algorithms import ADV_ESTIMATORS, compute_advantage
from torchrlhf.algorithms.advantages import EstimatorRegistry


def _outcome(scores, lengths, T=4):
    """Token-level rewards with each score on the last valid token, right-padded masks."""
    B = len(scores)
    rewards, mask = torch.zeros(B, T), torch.zeros(B, T)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def _gae_reference(rewards, values, mask, gamma, lam):
    """Slow reference: compress each row to its valid tokens, run textbook GAE, scatter back."""
    adv = torch.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[i, t] > 0]
        last, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[i, t].item() + gamma * next_v - values[i, t].item()
            last = delta + gamma * lam * last
            adv[i, t] = last
            next_v = values[i, t].item()
    return adv, (adv + values) * mask


def _whiten_reference(x, mask):
    vals = torch.tensor([x[i, t].item() for i in range(x.shape[0]) for t in range(x.shape[1]) if mask[i, t] > 0],
                        dtype=torch.float64)
    mean, var = vals.mean(), vals.var(unbiased=True)
    return ((x.double() - mean) / math.sqrt(var + 1e-8)).float() * mask


def test_gae_hole_by_hand():
    # mask [1,0,1]: the middle (tool) token is skipped. gamma=0.9, lam=0.8, V=0.5 everywhere.
    # t=2: delta = 1 + 0.9*0 - 0.5 = 0.5, A2 = 0.5
    # t=0: next value jumps over the hole to V2=0.5: delta = 0 + 0.9*0.5 - 0.5 = -0.05; A0 = -0.05 + 0.72*0.5 = 0.31
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.full((1, 3), 0.5)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.0, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.81, 0.0, 1.0]]))


def test_gae_matches_loop_reference_and_whitens():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    mask = (torch.rand(5, 7, generator=g) > 0.3).float()
    mask[0] = torch.tensor([1, 1, 0, 0, 1, 1, 0.0])  # holes inside a response
    mask[1] = 0  # empty response
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, 0.95, 0.9)
    adv, ret = compute_advantage("gae", rewards, mask, values=values, gamma=0.95, lam=0.9, whiten=False)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    adv_w, ret_w = compute_advantage("gae", rewards, mask, values=values, gamma=0.95, lam=0.9)
    torch.testing.assert_close(adv_w, _whiten_reference(ref_adv, mask))
    torch.testing.assert_close(ret_w, ref_ret)  # returns are taken before whitening


def test_gae_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantage("gae", torch.zeros(1, 2), torch.ones(1, 2))


def test_grpo_by_hand_groups_of_one_and_all_equal():
    # group a: [1, 0, 1]; mean 2/3; unbiased var = (1/9 + 4/9 + 1/9) / 2 = 1/3; std = 0.57735
    # -> (1/3)/0.57735 = 0.57735, (-2/3)/0.57735 = -1.15470. group b has one sample -> 0. group c all equal -> 0.
    rewards, mask = _outcome([1, 0, 1, 5, 2, 2], [2, 3, 4, 1, 2, 3])
    mask[2, 1] = 0  # a hole; the reward on the last token still counts
    index = ["a", "a", "a", "b", "c", "c"]
    adv, ret = compute_advantage("grpo", rewards, mask, index=index, epsilon=0.0)
    per_seq = torch.tensor([0.57735, -1.15470, 0.57735, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, per_seq[:, None] * mask, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ret, adv)
    assert not adv.isnan().any()


def test_dr_grpo_and_norm_adv_by_std_false():
    # group mean 2/3 -> 1/3, -2/3, 1/3
    rewards, mask = _outcome([1, 0, 1, 3], [2, 3, 4, 2])
    index = torch.tensor([7, 7, 7, 8])
    expected = torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.0])[:, None] * mask
    adv, _ = compute_advantage("dr_grpo", rewards, mask, index=index)
    torch.testing.assert_close(adv, expected)
    adv2, _ = compute_advantage("grpo", rewards, mask, index=index, norm_adv_by_std=False)
    torch.testing.assert_close(adv2, expected)


def test_rloo_by_hand():
    # r_i - mean of the others: 1 - (0+1)/2 = 0.5; 0 - (1+1)/2 = -1; 0.5. Singleton -> 0.
    rewards, mask = _outcome([1, 0, 1, 4], [1, 2, 3, 4])
    adv, _ = compute_advantage("rloo", rewards, mask, index=["x", "x", "x", "y"])
    torch.testing.assert_close(adv, torch.tensor([0.5, -1.0, 0.5, 0.0])[:, None] * mask)


def test_reinforce_pp_loop_reference():
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0.0]])
    gamma = 0.5
    returns = torch.zeros(4, 5)
    for i in range(4):  # return-to-go over valid tokens only
        running = 0.0
        for t in reversed(range(5)):
            if mask[i, t]:
                running = rewards[i, t].item() + gamma * running
                returns[i, t] = running
    adv, ret = compute_advantage("reinforce_pp", rewards, mask, gamma=gamma)
    torch.testing.assert_close(ret, returns)
    torch.testing.assert_close(adv, _whiten_reference(returns, mask))


def test_reinforce_pp_baseline():
    # scores [1, 3 | 2]: group means 2 -> centred [-1, 1 | singleton 0], broadcast then whitened over tokens
    rewards, mask = _outcome([1, 3, 2], [2, 1, 3])
    adv, ret = compute_advantage("reinforce_pp_baseline", rewards, mask, index=["a", "a", "b"])
    centred = torch.tensor([-1.0, 1.0, 0.0])[:, None] * mask
    torch.testing.assert_close(ret, centred)
    torch.testing.assert_close(adv, _whiten_reference(centred, mask))


def test_remax_by_hand():
    # rewards [0, 1, (masked 5)] -> return-to-go [1, 1, 0]; minus baseline 0.25 -> [0.75, 0.75, 0]
    rewards = torch.tensor([[0.0, 1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, ret = compute_advantage("remax", rewards, mask, reward_baselines=torch.tensor([0.25]))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0]]))
    torch.testing.assert_close(adv, torch.tensor([[0.75, 0.75, 0.0]]))
    with pytest.raises(ValueError, match="reward_baselines"):
        compute_advantage("remax", rewards, mask)


def test_opo_length_weighted_baseline():
    # group: (r=1, len 2), (r=0, len 4): baseline = (2*1 + 4*0) / 6 = 1/3 -> adv 2/3, -1/3; singleton -> 0
    rewards, mask = _outcome([1, 0, 9], [2, 4, 3])
    adv, _ = compute_advantage("opo", rewards, mask, index=["g", "g", "h"])
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, 0.0])[:, None] * mask)


def test_grpo_passk_best_only():
    # group [0.2, 0.9, 0.5]: best is sample 1, credit 0.9 - 0.5 = 0.4.
    # mean 0.5333; unbiased var = (0.11111 + 0.13444 + 0.00111) / 2 = 0.123333; std 0.351188 -> 0.4/0.351188 = 1.139
    rewards, mask = _outcome([0.2, 0.9, 0.5, 1.0, 1.0, 3.0], [1, 2, 3, 1, 2, 3])
    index = ["a", "a", "a", "b", "b", "c"]  # b: tie -> credit 0; c: singleton -> 0
    adv, _ = compute_advantage("grpo_passk", rewards, mask, index=index, epsilon=0.0)
    torch.testing.assert_close(adv, torch.tensor([0, 1.138990, 0, 0, 0, 0])[:, None] * mask, rtol=1e-4, atol=1e-5)
    adv, _ = compute_advantage("grpo_passk", rewards, mask, index=index, norm_adv_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([0, 0.4, 0, 0, 0, 0])[:, None] * mask)


@pytest.mark.parametrize(
    "name", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk", "reinforce_pp"]
)
def test_all_equal_rewards_no_nan(name):
    rewards, mask = _outcome([1, 1, 1, 1], [1, 2, 3, 4])
    adv, ret = compute_advantage(name, rewards, mask, index=["a", "a", "a", "a"])
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    if name != "reinforce_pp":  # all group-relative advantages vanish
        assert (adv == 0).all()


def test_bf16_inputs():
    rewards, mask = _outcome([1, 0, 1, 2], [2, 3, 4, 1])
    index = ["a", "a", "a", "b"]
    adv16, _ = compute_advantage("grpo", rewards.bfloat16(), mask.bfloat16(), index=index, epsilon=0.0)
    assert adv16.dtype == torch.bfloat16
    torch.testing.assert_close(adv16.float(), torch.tensor([0.57735, -1.15470, 0.57735, 0.0])[:, None] * mask,
                               rtol=1e-2, atol=1e-2)
    values = torch.full((4, 4), 0.5, dtype=torch.bfloat16)
    adv, ret = compute_advantage("gae", rewards.bfloat16(), mask.bfloat16(), values=values, whiten=False)
    ref_adv, _ = _gae_reference(rewards, values.float(), mask, 1.0, 1.0)
    torch.testing.assert_close(adv.float(), ref_adv, rtol=1e-2, atol=1e-2)


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'") as err:
        compute_advantage("nope", torch.zeros(1, 2), torch.ones(1, 2))
    valid = ("gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "opo", "grpo_passk")
    for name in valid:
        assert name in str(err.value)
        assert name in ADV_ESTIMATORS


def test_bad_shapes_and_missing_index():
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantage("grpo", torch.zeros(2, 3), torch.ones(2, 4), index=["a", "b"])
    with pytest.raises(ValueError, match="index"):
        compute_advantage("grpo", torch.zeros(2, 3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="index has 1 entries"):
        compute_advantage("grpo", torch.zeros(2, 3), torch.ones(2, 3), index=["a"])


# What each built-in estimator needs, written out here as the papers define them (not read from the registry).
GROUP = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk"}
VALUES = {"gae"}
GREEDY_BASELINE = {"remax"}


@pytest.mark.parametrize("name", ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax",
                                  "opo", "grpo_passk"])
def test_each_estimator_declares_its_traits_and_inputs(name):
    estimator = ADV_ESTIMATORS[name]
    assert (estimator.group, estimator.values, estimator.greedy_baseline) == (
        name in GROUP, name in VALUES, name in GREEDY_BASELINE)
    expected = {**({"index": "uid"} if name in GROUP else {}), **({"values": "values"} if name in VALUES else {}),
                **({"reward_baselines": "reward_baselines"} if name in GREEDY_BASELINE else {})}
    assert estimator.inputs == expected
    for trait, members in (("group", GROUP), ("values", VALUES), ("greedy_baseline", GREEDY_BASELINE)):
        assert (name in ADV_ESTIMATORS.having(trait)) == (name in members)


def test_registration_keeps_the_function_and_refuses_contradicting_traits():
    registry = EstimatorRegistry("advantage estimator")

    @registry.register("mine", "mine_alias", group=True)
    def mine(token_level_rewards, response_mask, *, index, **_):
        return token_level_rewards, token_level_rewards

    assert mine.__name__ == "mine"  # the decorator hands the plain function back
    assert registry["mine"].fn is mine and registry["mine_alias"] == registry["mine"]
    assert registry["mine"].inputs == {"index": "uid"} and registry.having("group") == ["mine", "mine_alias"]
    assert registry.having("values") == []
    with pytest.raises(ValueError, match="already registered"):
        registry.register("mine")(mine)
    with pytest.raises(ValueError, match="group .* and greedy_baseline .* exclude each other"):
        registry.register("both", group=True, greedy_baseline=True)
