import pytest
import torch

from torchrlhf.algorithms import (
    LagrangeMultiplier,
    Lagrangian,
    OverlongBuffer,
    combine_safe_advantages,
    filter_groups,
    overlong_penalty,
)


def test_lagrange_multiplier_by_hand():
    lm = LagrangeMultiplier(init=1.0, lr=0.5, threshold=0.2)
    assert lm.update(1.2) == pytest.approx(1.5)  # 1 + 0.5 * (1.2 - 0.2)
    assert lm.update(torch.tensor(-5.0)) == 0.0  # 1.5 + 0.5 * (-5.2) < 0 -> projected to 0
    capped = LagrangeMultiplier(init=1.5, lr=0.5, threshold=0.2, max_value=1.6)
    assert capped.update(2.2) == pytest.approx(1.6)  # 1.5 + 1.0 = 2.5 -> capped
    restored = LagrangeMultiplier(init=0.0, lr=0.5, threshold=0.2)
    restored.load_state_dict(capped.state_dict())
    assert restored.value == pytest.approx(1.6)
    with pytest.raises(ValueError, match="init"):
        LagrangeMultiplier(init=-1.0, lr=0.1, threshold=0.0)


def test_lagrangian_section_is_the_multipliers_arguments():
    lm = Lagrangian(init=1.5, lr=0.5, threshold=0.2, max_value=1.6).multiplier()
    assert (lm.value, lm.lr, lm.threshold, lm.max_value) == (1.5, 0.5, 0.2, 1.6)
    assert lm.update(2.2) == pytest.approx(1.6)
    default = Lagrangian().multiplier()  # the defaults of the flat keys it replaced
    assert (default.value, default.lr, default.threshold, default.max_value) == (1.0, 0.05, 0.0, None)
    with pytest.raises(ValueError, match="init: must be >= 0"):
        Lagrangian(init=-1.0)


def test_combine_safe_advantages_by_hand():
    # (2 - 1*1) / (1 + 1) = 0.5; (0 - 1*(-1)) / 2 = 0.5; lam = 0 -> reward advantage unchanged
    ar, ac = torch.tensor([2.0, 0.0]), torch.tensor([1.0, -1.0])
    torch.testing.assert_close(combine_safe_advantages(ar, ac, 1.0), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(combine_safe_advantages(ar, ac, torch.tensor(0.0)), ar)
    # (2 - 3) / 4 = -0.25
    torch.testing.assert_close(combine_safe_advantages(ar[:1], ac[:1], 3.0), torch.tensor([-0.25]))


def test_overlong_penalty_by_hand():
    # max 20, buffer 4, factor 1: penalty starts after 16; (len - 16) / 4 linear to -1 at 20
    lengths = torch.tensor([10, 16, 17, 18, 20])
    torch.testing.assert_close(
        overlong_penalty(lengths, 20, 4, 1.0), torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0])
    )
    torch.testing.assert_close(overlong_penalty(torch.tensor([19]), 20, 4, 0.5), torch.tensor([-0.375]))
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(lengths, 20, 0, 1.0)
    section = OverlongBuffer(len=4, penalty_factor=0.5)
    assert section.enabled and not OverlongBuffer().enabled
    torch.testing.assert_close(section.penalty(lengths, 20), overlong_penalty(lengths, 20, 4, 0.5))
    with pytest.raises(ValueError, match="len: must be >= 0"):
        OverlongBuffer(len=-1)


def test_filter_groups():
    # a: all 1 (drop), b: 0/1 (keep), c: singleton (drop), d: 2/2 (drop)
    index = ["a", "a", "b", "b", "c", "d", "d"]
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 5.0, 2.0, 2.0])
    keep, dropped = filter_groups(index, scores)
    assert keep.tolist() == [False, False, True, True, False, False, False]
    assert dropped == 3
    keep, dropped = filter_groups(["x", "y", "x", "y"], torch.tensor([0.0, 1.0, 1.0, 1.0]).bfloat16())
    assert keep.tolist() == [True, False, True, False] and dropped == 1
