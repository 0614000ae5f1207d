"""Reward functions by name: built-in rules by ``data_source``, user functions by path.

A reward function is ``fn(solution_str, ground_truth, **kwargs) -> float`` (or a dict with a
``"score"`` entry). User functions are found by

- dotted path: ``my_pkg.rewards:score`` or ``my_pkg.rewards.score``,
- file path: ``/path/to/rewards.py:score``.

Security: user reward code is ordinary Python run with the permissions of the user who
launched training (in `RewardManager`'s worker processes); only load code you trust.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable

from torchrlhf.config import get_component
from torchrlhf.rewards import arithmetic, countdown, gsm8k, math_answer

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
}

# Built-ins whose cost is bounded (regex / AST walk over the response): safe to run in-process
# without a time limit. Everything else (sympy-based math, user code) runs in worker processes.
IN_PROCESS_SAFE: frozenset[RewardFn] = frozenset({gsm8k.compute_score, countdown.compute_score, arithmetic.compute_score})


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
    path, sep, name = spec.rpartition(":")
    if sep and (path.endswith(".py") or os.sep in path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"reward function file not found: {path} (from {spec!r})")
        module_name = "torchrlhf_user_reward_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        if not hasattr(module, name):
            public = [n for n in vars(module) if not n.startswith("_")]
            raise ValueError(f"reward function {name!r} not found in {path}; it defines {public}")
        fn = getattr(module, name)
    else:
        fn = get_component(spec)
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is not callable (got {type(fn).__name__})")
    return fn
