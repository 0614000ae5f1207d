"""Wall-clock timing of the phases of a step, reported as ``timing_s/<name>`` metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager


@contextmanager
def timer(name: str, timings: MutableMapping[str, float], *, accumulate: bool = False) -> Iterator[None]:
    """Time the block into ``timings["timing_s/<name>"]`` (added to the old value with ``accumulate``).

    The time is recorded even when the block raises, so a failing step still shows where it spent time.
    """
    key = f"timing_s/{name}"
    start = time.perf_counter()
    try:
        yield
    finally:
        elapsed = time.perf_counter() - start
        timings[key] = timings.get(key, 0.0) + elapsed if accumulate else elapsed
