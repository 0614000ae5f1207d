"""Number parsing shared by the rule rewards."""

from __future__ import annotations

import re
from fractions import Fraction

# An optional sign (touching the digits: "13 - 6" holds no -6) or dollar sign, digits with optional
# thousands commas, an optional decimal part; or a bare ".5".
NUMBER_RE = re.compile(r"(?:-?\$\s?|-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


def parse_number(text: str | None) -> Fraction | None:
    """``"$1,234.50"`` -> Fraction(2469, 2); None when ``text`` is not a single number.

    Exact (Fraction) so that ``"72"``, ``"72.0"`` and ``"72.00"`` compare equal without float noise.
    """
    if text is None:
        return None
    s = str(text).strip().replace(",", "").replace("$", "").replace(" ", "")
    s = s.rstrip(".")
    if s.endswith("%"):
        s = s[:-1]
    if not s:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(int(num), int(den))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


_MARKED = [re.compile(r"####\s*(" + NUMBER_RE.pattern + ")"),
           re.compile(r"[Tt]he (?:final )?answer is[:\s]*\**\s*(" + NUMBER_RE.pattern + ")"),
           re.compile(r"\\boxed\{\s*(" + NUMBER_RE.pattern + r")\s*\}")]
_AFTER_EQUALS = re.compile(r"=\s*(" + NUMBER_RE.pattern + ")")


def marked_answer(text: str) -> str | None:
    """The last explicitly marked answer: ``#### 42``, "the answer is 42" or ``\\boxed{42}``."""
    marked = [m for pattern in _MARKED for m in pattern.finditer(text)]
    return max(marked, key=lambda m: m.start()).group(1) if marked else None


def extract_final_number(text: str, *, after_equals: bool = True) -> str | None:
    """The final answer of a free-form response, or None when it has no number.

    In order: the last marked answer, else (with ``after_equals``) the number after the last ``=``
    ("5 + 3 = 8 is 5 plus 3" -> 8), else the last number (GSM8K's "flexible" grading).
    """
    answer = marked_answer(text)
    if answer is not None:
        return answer
    if after_equals:
        found = list(_AFTER_EQUALS.finditer(text))
        if found:
            return found[-1].group(1)
    numbers = NUMBER_RE.findall(text)
    return numbers[-1] if numbers else None


def numbers_equal(a: str | None, b: str | None) -> bool:
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


def integer_score(task: str, answer: str | None, ground_truth: str | int) -> float:
    """1.0 when ``answer`` equals the integer ``ground_truth``, else 0.0; a reference that is not an integer
    is a data error (named by ``task``), not a wrong answer."""
    reference = parse_number(str(ground_truth))
    if reference is None or reference.denominator != 1:
        raise ValueError(f"{task}: ground truth {ground_truth!r} is not an integer")
    value = parse_number(answer)
    return 1.0 if value is not None and value == reference else 0.0
