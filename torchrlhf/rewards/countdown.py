"""Countdown: combine the given numbers, each exactly once, with + - * / into the target.

The equation is the last ``<answer>...</answer>`` block (TinyZero format), or else the last
line of the response that looks like an equation. A trailing ``= target`` is ignored. The
expression is evaluated exactly (fractions) by walking its AST: only numbers, parentheses,
unary minus and the four operators are allowed, so nothing in the response is executed.

``ground_truth`` is ``{"target": int, "numbers": [int, ...]}`` or that mapping as JSON.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_EQUATION_LINE = re.compile(r"^[\d\s+\-*/().=]+$")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b}


def parse_ground_truth(ground_truth: str | Mapping[str, Any]) -> tuple[int, list[int]]:
    gt = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    try:
        return int(gt["target"]), [int(n) for n in gt["numbers"]]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"countdown: ground truth must hold 'target' and 'numbers', got {ground_truth!r}") from e


def extract_equation(solution_str: str) -> str | None:
    blocks = _ANSWER.findall(solution_str)
    if blocks:
        candidate = blocks[-1]
    else:
        lines = [ln.strip() for ln in solution_str.splitlines() if ln.strip()]
        candidate = next((ln for ln in reversed(lines) if _EQUATION_LINE.match(ln) and any(c.isdigit() for c in ln)), None)
        if candidate is None:
            return None
    return candidate.split("=")[0].strip() or None


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """(exact value, the integer literals used); ValueError for anything but + - * / on integers."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = walk(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"disallowed element {type(node).__name__} in {expression!r}")

    return walk(tree.body), used


def compute_score(
    solution_str: str, ground_truth: str | Mapping[str, Any], *, format_score: float = 0.0, score: float = 1.0
) -> float:
    """``score`` if the equation is valid and hits the target, ``format_score`` if one was given but is wrong."""
    target, numbers = parse_ground_truth(ground_truth)
    equation = extract_equation(solution_str)
    if equation is None:
        return 0.0
    try:
        value, used = evaluate(equation)
    except (ValueError, RecursionError):  # malformed, or nested too deep to walk
        return format_score
    if sorted(used) != sorted(numbers):
        return format_score
    return score if value == target else format_score
