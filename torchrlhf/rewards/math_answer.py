"""Math answer equivalence (MATH, AIME-style problems): the final answer must equal the reference.

With ``math-verify`` installed (``pip install math-verify``) answers are parsed as LaTeX /
expressions and compared symbolically (``\\frac{1}{2}`` == ``0.5``, ``x+1`` == ``1+x``,
intervals, sets). Without it, the last ``\\boxed{...}`` is compared to the reference after a
string normalisation (spaces, ``\\left``/``\\right``, ``\\dfrac``, units, ``$``), or
numerically when both sides are numbers.

Symbolic comparison can be slow on adversarial inputs, so `RewardManager` runs this
function in its worker processes under the time limit instead of in-process.
"""

from __future__ import annotations

import functools
import logging
import re

from torchrlhf.rewards._numbers import numbers_equal

@functools.cache
def _math_verify():
    """math-verify's ``(parse, verify)``, or None without it: imported at the first MATH score, not with the
    library (it and sympy cost every process a quarter of a second at start-up)."""
    try:
        from math_verify import parse, verify
    except ImportError:  # optional dependency
        return None
    # We call with its timeouts off (see compute_score); silence its per-call warning about that.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))
    return parse, verify


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        # "\boxed 5" (no braces)
        m = re.match(r"\\boxed\s+([^\s$]+)", text[start:])
        return m.group(1) if m else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


_REMOVE = ["\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle", "$", "^\\circ", "^{\\circ}", "\\%", "%"]


def normalize_answer(answer: str) -> str:
    """A canonical string form for comparing answers without a CAS."""
    s = answer.strip()
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = re.sub(r"\\mbox\{\s*([^}]*)\}", r"\1", s)
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("\\ne", "\\neq").replace("\\neqq", "\\neq")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 -> \frac{1}{2}
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"\s*(units?|degrees?|cm|meters?|inches|dollars?)\s*$", "", s)
    s = re.sub(r"^[a-zA-Z]\s*=", "", s)  # "x = 5" -> "5"
    s = s.replace(" ", "").rstrip(".")
    if s.startswith("0.") is False and s.startswith("."):
        s = "0" + s
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    return s


def _fallback_equal(solution_str: str, ground_truth: str) -> bool:
    answer = last_boxed(solution_str)
    if answer is None:
        return False
    a, b = normalize_answer(answer), normalize_answer(ground_truth)
    return a == b or numbers_equal(a, b)


def compute_score(solution_str: str, ground_truth: str, *, use_math_verify: bool = True) -> float:
    """1.0 when the response's final answer is equivalent to ``ground_truth``, else 0.0."""
    mv = _math_verify() if use_math_verify else None
    if mv is not None:
        parse, verify = mv
        # Timeouts are ours (RewardManager); math-verify's own use signal.alarm, which fails off the main thread.
        gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=None)
        pred = parse(solution_str, parsing_timeout=None)
        if gold and pred and verify(gold, pred, timeout_seconds=None):
            return 1.0
        return 0.0
    return 1.0 if _fallback_equal(solution_str, ground_truth) else 0.0
