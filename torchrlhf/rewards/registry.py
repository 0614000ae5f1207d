"""Reward functions by name: built-in rules by ``data_source``, user functions by path.

A reward function is ``fn(solution_str, ground_truth, **kwargs) -> float`` (or a dict with a
``"score"`` entry). User functions are found by

- dotted path: ``my_pkg.rewards:score`` or ``my_pkg.rewards.score``,
- file path: ``/path/to/rewards.py:score``.

Security: user reward code is ordinary Python run with the permissions of the user who
launched training (in `RewardManager`'s worker processes); only load code you trust.
"""

from __future__ import annotations

from collections.abc import Callable

from torchrlhf.config import load_callable
from torchrlhf.rewards import arithmetic, calculator, countdown, gsm8k, math_answer

RewardFn = Callable[..., float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k.compute_score,
    "gsm8k": gsm8k.compute_score,
    "math": math_answer.compute_score,
    "lighteval/MATH": math_answer.compute_score,
    "DigitalLearningGmbH/MATH-lighteval": math_answer.compute_score,
    "HuggingFaceH4/MATH-500": math_answer.compute_score,
    "countdown": countdown.compute_score,
    "arithmetic": arithmetic.compute_score,
    "calculator": calculator.compute_score,
}

# Built-ins whose cost is bounded (regex / AST walk over the response): safe to run in-process
# without a time limit. Everything else (sympy-based math, user code) runs in worker processes.
IN_PROCESS_SAFE: frozenset[RewardFn] = frozenset(
    {gsm8k.compute_score, countdown.compute_score, arithmetic.compute_score, calculator.compute_score})


def get_reward_fn(data_source: str) -> RewardFn:
    """The built-in reward for ``data_source``; ValueError listing the known sources."""
    try:
        return REWARD_FUNCTIONS[data_source]
    except KeyError:
        raise ValueError(
            f"no built-in reward for data_source {data_source!r}; known: {sorted(REWARD_FUNCTIONS)}. "
            "Pass a reward function (e.g. 'my_pkg.rewards:score' or '/path/file.py:score') for other data."
        ) from None


def load_reward_fn(spec: str) -> RewardFn:
    """Import a user reward function from ``pkg.mod:fn``, ``pkg.mod.fn`` or ``/path/file.py:fn``."""
    return load_callable(spec, what="reward function")
