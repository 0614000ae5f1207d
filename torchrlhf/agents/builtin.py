"""Example tools and environments shipped with torchrlhf.

``calculator`` evaluates arithmetic with an AST walk (no ``eval``): numbers, ``+ - * / // % **``
and parentheses only, with bounds on the size of powers and of intermediate results so that no
expression can hang a worker or exhaust its memory. ``GuessNumber`` is a multi-turn environment
with higher/lower hints.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from fractions import Fraction
from typing import Any

from torchrlhf.data.dataset import reference

_MAX_EXPRESSION_CHARS = 200
_MAX_EXPONENT = 64
_MAX_DIGITS = 100

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponents must be integers with |exponent| <= {_MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise ValueError("division by zero")
            result = left ** int(right)
        elif type(node.op) in _BINARY:
            if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
                raise ValueError("division by zero")
            result = Fraction(_BINARY[type(node.op)](left, right))
        else:
            raise ValueError(f"unsupported operator {type(node.op).__name__}")
        if len(str(abs(result.numerator))) > _MAX_DIGITS or len(str(result.denominator)) > _MAX_DIGITS:
            raise ValueError(f"result has more than {_MAX_DIGITS} digits")
        return result
    raise ValueError(f"unsupported syntax {type(node).__name__}: use numbers, + - * / // % ** and parentheses")


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.10g}"
    return text


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "231 * 47 + 5".
    """
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if len(text) > _MAX_EXPRESSION_CHARS:
        return f"Error: expression longer than {_MAX_EXPRESSION_CHARS} characters"
    # Thousands separators ("1,234") are common in model output; a comma is never an operator here.
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)
    try:
        tree = ast.parse(text, mode="eval")
        return _format(_evaluate(tree))
    except (SyntaxError, ValueError, OverflowError) as e:
        return f"Error: {e.msg if isinstance(e, SyntaxError) else e}"


class GuessNumber:
    """Guess a secret integer in ``[low, high]``; each wrong guess gets a "higher"/"lower" hint.

    The secret comes from the data row's reference answer (`torchrlhf.data.dataset.reference`) when it has one (reproducible evaluation),
    else from ``seed``. Reward 1.0 on the turn that guesses it, 0.0 otherwise; a turn without a
    number gets a reminder and no reward.
    """

    def __init__(self, low: int = 1, high: int = 100, seed: int | None = None) -> None:
        if low > high:
            raise ValueError(f"GuessNumber: low {low} > high {high}")
        self.low, self.high = low, high
        self._rng = random.Random(seed)
        self.secret: int | None = None
        self.guesses = 0

    def reset(self, row: dict[str, Any]) -> str:
        truth = reference(row)
        self.secret = int(truth) if truth is not None else self._rng.randint(self.low, self.high)
        if not self.low <= self.secret <= self.high:
            raise ValueError(f"GuessNumber: secret {self.secret} outside [{self.low}, {self.high}]")
        self.guesses = 0
        return (f"I am thinking of an integer between {self.low} and {self.high}. Guess it: reply with one number. "
                "I will say whether the secret is higher or lower.")

    def step(self, text: str) -> tuple[str | None, float, bool]:
        numbers = re.findall(r"-?\d+", text)
        if not numbers:
            return "Reply with one number.", 0.0, False
        self.guesses += 1
        guess = int(numbers[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False
