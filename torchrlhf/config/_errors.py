"""The one exception type of the config package."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class ConfigError(ValueError):
    """A bad config file, override, component or value.

    A ``ValueError`` (not ``SystemExit``) so a notebook can catch it and fix the config.
    """


def close_matches(word: str, candidates: Iterable[str], n: int = 3) -> str:
    """`` (did you mean 'a', 'b'?)`` or an empty string."""
    matches = difflib.get_close_matches(word, list(candidates), n=n, cutoff=0.6)
    return f" (did you mean {', '.join(repr(m) for m in matches)}?)" if matches else ""
