"""The toy arithmetic task ("What is 3 + 4?" -> "7") used to check that a tiny model learns.

The first integer in the response must equal the reference exactly; "7", " 7.", "7 apples"
score 1, "8" or no number scores 0. Kept lenient about surrounding text so a model trained
from scratch gets a learning signal before it masters the output format.
"""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    m = _INT.search(solution_str)
    if m is None:
        return 0.0
    try:
        return 1.0 if int(m.group()) == int(str(ground_truth).strip()) else 0.0
    except ValueError:
        raise ValueError(f"arithmetic: ground truth {ground_truth!r} is not an integer") from None
