"""Number parsing shared by the rule rewards."""

from __future__ import annotations

import re
from fractions import Fraction

# An optional sign, digits with optional thousands commas, an optional decimal part; or a bare ".5".
NUMBER_RE = re.compile(r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")


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


def numbers_equal(a: str | None, b: str | None) -> bool:
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y
