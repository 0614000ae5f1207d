import math

import pytest
import torch

from torchrlhf.algorithms import AdaptiveKLController, FixedKLController, KLControl, apply_kl_penalty, kl_penalty

LN2 = math.log(2.0)


def _lp():
    # log pi = ln 0.5, log ref = ln 0.25 -> diff = ln 2
    return torch.tensor([math.log(0.5)], requires_grad=True), torch.tensor([math.log(0.25)])


@pytest.mark.parametrize(
    "kind, value, grad",
    [
        ("k1", LN2, 1.0),
        ("kl", LN2, 1.0),
        ("abs", LN2, 1.0),
        ("k2", 0.5 * LN2**2, LN2),  # 0.5 d^2, grad d
        ("mse", 0.5 * LN2**2, LN2),
        # k3: x = ref - lp = -ln2; e^x - x - 1 = 0.5 + ln2 - 1; grad wrt lp = 1 - e^x = 0.5
        ("k3", 0.5 + LN2 - 1, 0.5),
        ("low_var_kl", 0.5 + LN2 - 1, 0.5),
        # straight-through: value of the base kind, gradient of k2 (= d = ln 2)
        ("k1+", LN2, LN2),
        ("k2+", 0.5 * LN2**2, LN2),
        ("k3+", 0.5 + LN2 - 1, LN2),
    ],
)
def test_kl_values_and_gradients(kind, value, grad):
    lp, ref = _lp()
    out = kl_penalty(lp, ref, kind)
    torch.testing.assert_close(out, torch.tensor([value]))
    out.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([grad]))


def test_k3_clamped():
    # lp - ref = -50: x = 50 clamped to 20, e^20 - 21 then clamped to 10
    assert kl_penalty(torch.tensor([-50.0]), torch.tensor([0.0]), "k3").item() == 10.0
    assert torch.isfinite(kl_penalty(torch.tensor([50.0]), torch.tensor([0.0]), "k3+")).all()


def test_bf16_kl():
    lp, ref = torch.tensor([math.log(0.5)]).bfloat16(), torch.tensor([math.log(0.25)]).bfloat16()
    out = kl_penalty(lp, ref, "k3")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), torch.tensor([0.5 + LN2 - 1]), rtol=2e-2, atol=2e-2)


def test_unknown_kind():
    for kind in ("k4", "k4+", "full"):
        with pytest.raises(ValueError, match="valid kinds: k1"):
            kl_penalty(torch.zeros(1), torch.zeros(1), kind)


def test_adaptive_controller_by_hand():
    c = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    c.update(current_kl=12.0, n_steps=100)  # error 1 clipped to 0.2 -> x(1 + 0.2*100/10000) = 0.1002
    assert c.value == pytest.approx(0.1002)
    c.load_state_dict({"value": 0.1})
    c.update(current_kl=6.6, n_steps=100)  # error 0.1 -> x1.001
    assert c.value == pytest.approx(0.1001)
    c.load_state_dict({"value": 0.1})
    c.update(current_kl=0.0, n_steps=100)  # error -1 clipped to -0.2 -> x0.998
    assert c.value == pytest.approx(0.0998)
    assert c.state_dict() == {"value": pytest.approx(0.0998)}
    f = FixedKLController(0.3)
    f.update(100.0, 10)
    assert f.value == 0.3
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)


def test_kl_ctrl_section_builds_its_controller_and_checks_itself():
    fixed = KLControl().controller()  # the defaults: fixed at 0.001
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.001
    adaptive = KLControl(type="adaptive", kl_coef=0.1, target_kl=6.0, horizon=10000).controller()
    adaptive.update(current_kl=12.0, n_steps=100)
    assert isinstance(adaptive, AdaptiveKLController) and adaptive.value == pytest.approx(0.1002)
    KLControl(target_kl=0.0)  # a fixed controller reads neither target_kl nor horizon
    for kwargs, match in [({"type": "adaptive", "target_kl": 0.0}, "target_kl: must be > 0"),
                          ({"type": "adaptive", "horizon": 0}, "horizon: must be > 0"),
                          ({"kl_coef": -0.1}, "kl_coef: must be >= 0"), ({"type": "pid"}, "type: must be")]:
        with pytest.raises(ValueError, match=match):
            KLControl(**kwargs)


def test_apply_kl_penalty_by_hand():
    # k1 = ln 2 on the 2 valid tokens; rewards = scores - 0.1 ln2 there; padding untouched
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old = torch.full((2, 3), math.log(0.5))
    ref = torch.full((2, 3), math.log(0.25))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    ctrl = AdaptiveKLController(0.1, target_kl=1.0, horizon=100)
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, ctrl, kind="k1")
    p = 0.1 * LN2
    torch.testing.assert_close(rewards, torch.tensor([[-p, -p, 1.0], [-p, 2 - p, -p]]))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(LN2)
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    assert ctrl.value == 0.1  # pure: the caller updates the controller
