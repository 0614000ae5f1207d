"""GSM8K: the final numeric answer must equal the reference.

Two extraction styles:

- ``strict``: the answer must be marked, either GSM8K's ``#### 42`` or "The answer is 42"
  (the last marked answer counts);
- ``flexible``: like strict, and otherwise the last number in the response.

Numbers compare exactly after removing thousands commas and ``$`` (``"$1,000.00" == "1000"``).
"""

from __future__ import annotations

import re

from torchrlhf.rewards._numbers import NUMBER_RE, numbers_equal

_NUM = r"(-?\$?\s?[\d,]*\.?\d+)"
_MARKED = [re.compile(r"####\s*" + _NUM), re.compile(r"[Tt]he (?:final )?answer is[:\s]*\**\s*" + _NUM)]


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string in ``solution_str`` or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k: method must be 'strict' or 'flexible', got {method!r}")
    best: tuple[int, str] | None = None
    for pattern in _MARKED:
        for m in pattern.finditer(solution_str):
            if best is None or m.start() > best[0]:
                best = (m.start(), m.group(1))
    if best is not None:
        return best[1].strip()
    if method == "flexible":
        numbers = NUMBER_RE.findall(solution_str)
        if numbers:
            return numbers[-1].strip()
    return None


def compute_score(
    solution_str: str, ground_truth: str, *, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` for the right answer, ``format_score`` for a wrong but extractable one, else 0."""
    answer = extract_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if numbers_equal(answer, ground_truth) else format_score
