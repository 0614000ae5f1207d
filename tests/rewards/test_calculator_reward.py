from __future__ import annotations

import pytest

from torchrlhf.rewards import calculator, get_reward_fn


@pytest.mark.parametrize(
    "text, expected",
    [("The answer is 4395264.", 1.0), ("The answer is 4,395,264", 1.0), ("the final answer is: 4395264", 1.0),
     ("The final answer is 4395264", 1.0), ("#### 4395264", 1.0), ("\\boxed{4395264}", 1.0),
     ("The answer is 4395265.", 0.0),
     # Unmarked numbers never count: a tool observation in the text must not score a silent trajectory.
     ("4395264", 0.0), ("<calc>472 * 96 * 97</calc>\nuser\n4395264\nassistant\nI used the calculator.", 0.0),
     # The last marked answer wins.
     ("The answer is 5. No wait, the answer is 4395264.", 1.0), ("The answer is 4395264. Oops, the answer is 5.", 0.0)],
)
def test_calculator_needs_the_marked_answer(text, expected):
    assert calculator.compute_score(text, "4395264") == expected


def test_calculator_registered_and_rejects_non_integer_truth():
    assert get_reward_fn("calculator") is calculator.compute_score
    with pytest.raises(ValueError, match="not an integer"):
        calculator.compute_score("The answer is 1.", "1.5")
