"""GSM8K: the final numeric answer must equal the reference.

Two extraction styles:

- ``strict``: the answer must be marked, GSM8K's ``#### 42``, "The answer is 42" or ``\\boxed{42}``
  (the last marked answer counts);
- ``flexible``: like strict, and otherwise the last number in the response.

Numbers compare exactly after removing thousands commas and ``$`` (``"$1,000.00" == "1000"``).
"""

from __future__ import annotations

from torchrlhf.rewards._numbers import extract_final_number, marked_answer, numbers_equal


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string in ``solution_str`` or None."""
    if method == "strict":
        answer = marked_answer(solution_str)
    elif method == "flexible":
        answer = extract_final_number(solution_str, after_equals=False)
    else:
        raise ValueError(f"gsm8k: method must be 'strict' or 'flexible', got {method!r}")
    return None if answer is None else answer.strip()


def compute_score(
    solution_str: str, ground_truth: str, *, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong but extractable one, else 0."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if numbers_equal(answer, ground_truth) else format_score
