from __future__ import annotations

import json

import pytest

from torchrlhf.rewards import arithmetic, countdown, gsm8k, math_answer
from torchrlhf.rewards.registry import REWARD_FUNCTIONS, get_reward_fn


@pytest.mark.parametrize(
    "text, gt, method, expected",
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", "72", "strict", 1.0),
        ("#### 1,000", "1000", "strict", 1.0),              # thousands comma
        ("#### $1000.00", "1000", "strict", 1.0),           # dollar sign, trailing zeros
        ("So the answer is 72.", "72", "strict", 1.0),      # "The answer is" style
        ("The final answer is: **72**", "72", "strict", 1.0),
        ("#### 71", "72", "strict", 0.0),                   # wrong
        ("#### 71 ... wait, #### 72", "72", "strict", 1.0),  # the last marked answer counts
        ("48 + 24 = 72", "72", "strict", 0.0),              # unmarked: strict finds nothing
        ("48 + 24 = 72", "72", "flexible", 1.0),            # flexible: last number
        ("72 is close but it is 73", "72", "flexible", 0.0),
        ("no numbers here", "72", "flexible", 0.0),         # malformed
        ("", "72", "strict", 0.0),
    ],
)
def test_gsm8k(text, gt, method, expected):
    assert gsm8k.compute_score(text, gt, method=method) == expected


def test_gsm8k_format_score_and_bad_method():
    assert gsm8k.compute_score("#### 5", "6", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "6", format_score=0.1) == 0.0
    assert gsm8k.extract_answer("x #### -3.5") == "-3.5"
    with pytest.raises(ValueError, match="strict"):
        gsm8k.compute_score("#### 1", "1", method="loose")


@pytest.mark.parametrize("use_math_verify", [True, False])
@pytest.mark.parametrize(
    "text, gt, expected",
    [
        ("so the result is $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("\\boxed{\\left( 1, 2 \\right]}", "(1,2]", 1.0),
        ("\\boxed{3}", "4", 0.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("\\boxed{", "1", 0.0),      # malformed: unclosed brace
        ("I give up", "1", 0.0),     # no answer
    ],
)
def test_math_answer(text, gt, expected, use_math_verify):
    if use_math_verify:
        pytest.importorskip("math_verify")
    assert math_answer.compute_score(text, gt, use_math_verify=use_math_verify) == expected


def test_math_answer_symbolic_with_math_verify():
    pytest.importorskip("math_verify")
    assert math_answer.compute_score("\\boxed{x + 1}", "1 + x") == 1.0
    assert math_answer.compute_score("\\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0


def test_last_boxed_matches_braces():
    assert math_answer.last_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert math_answer.last_boxed("nothing") is None


GT = {"target": 24, "numbers": [3, 5, 3]}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>try</think><answer>(3 + 5) * 3</answer>", 1.0),
        ("<answer>(3+5)*3 = 24</answer>", 1.0),          # trailing "= target" ignored
        ("reasoning...\n(5 + 3) * 3", 1.0),               # last equation line without tags
        ("<answer>3 * 5 + 3</answer>", 0.5),              # 18: wrong value
        ("<answer>(3 + 5) * 3 + 0</answer>", 0.5),        # extra number
        ("<answer>8 * 3</answer>", 0.5),                  # numbers not as given
        ("<answer>(3+5)*3*1/1</answer>", 0.5),
        ("<answer>__import__('os').system('true')</answer>", 0.5),  # never executed
        ("<answer>3 ** 5</answer>", 0.5),                 # power not allowed
        ("<answer>3 / (5 - 5) + 3</answer>", 0.5),        # division by zero
        ("no equation", 0.0),
    ],
)
def test_countdown(text, expected):
    assert countdown.compute_score(text, GT, format_score=0.5) == expected
    assert countdown.compute_score(text, json.dumps(GT), format_score=0.5) == expected


def test_countdown_exact_division():
    assert countdown.compute_score("<answer>(8 / 3) * 3 * 3</answer>", {"target": 24, "numbers": [8, 3, 3, 3]}) == 1.0
    with pytest.raises(ValueError, match="target"):
        countdown.compute_score("<answer>1</answer>", {"numbers": [1]})


@pytest.mark.parametrize(
    "text, gt, expected",
    [("7", "7", 1.0), (" 7.", "7", 1.0), ("-3", "-3", 1.0), ("8", "7", 0.0), ("seven", "7", 0.0), ("", "7", 0.0),
     ("17", "7", 0.0), ("7 apples", "7", 1.0),
     # SmolLM2 restates the question: the final number is graded, not the first operand.
     ("13 - 6 = 7", "7", 1.0), ("13 - 6 = 8", "7", 0.0), ("13 - 6 = 7. The answer is 7.", "7", 1.0),
     ("The answer is 7, since 13 - 6 leaves 7", "7", 1.0), ("#### 7", "7", 1.0), ("\\boxed{-4}", "-4", 1.0),
     # After "=" wins over a later restated operand; a spaced minus is not a sign.
     ("5 + 3 = 8 is 5 plus 3", "8", 1.0), ("20 - 6", "-6", 0.0), ("20 - 6", "6", 1.0), ("x = -3.", "-3", 1.0)],
)
def test_arithmetic(text, gt, expected):
    assert arithmetic.compute_score(text, gt) == expected


def test_arithmetic_rejects_non_integer_ground_truth():
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic.compute_score("7", "7.5")


def test_registry():
    assert get_reward_fn("openai/gsm8k") is gsm8k.compute_score
    assert REWARD_FUNCTIONS["arithmetic"] is arithmetic.compute_score
    with pytest.raises(ValueError, match="no built-in reward for data_source 'nope'.*openai/gsm8k"):
        get_reward_fn("nope")
