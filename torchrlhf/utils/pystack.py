"""Run a hot loop at the start of its own Python data-stack chunk (CPython 3.11-3.13).

CPython keeps frames in 16 KiB chunks and, before 3.13.x / 3.14 (python/cpython#142183), frees a chunk
the moment the frame that opened it returns. A loop whose calls land exactly on a chunk boundary then
maps and unmaps 16 KiB on every call. Where the boundary falls depends on how deep the caller's stack
already is, so the same code runs at two speeds from two call sites: the compiled decode step calls a
Python kernel wrapper ~210 times per step, and on SmolLM2 bf16 it ran at 310 tok/s from one script and
450 from another, the difference all in ``mmap``/``munmap`` (``strace``: 16384-byte maps, one per call).

`in_fresh_stack_chunk` calls a function from a frame too big for any chunk's free space, so CPython
opens a 64 KiB chunk for it; that frame lives for the whole loop, and everything the loop calls (up to
~31 KiB of frames) stays inside the chunk: no boundary to cross, whatever the caller's depth.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Local slots of the spacer frame: 4200 x 8 bytes ~ 33 KiB, more than a 16 KiB chunk holds and more than
# half of 64 KiB, so the frame opens a 64 KiB chunk of its own (sizes double from 16 KiB) with ~31 KiB free.
_SPACER_SLOTS = 4200


def _call(fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    return fn(*args, **kwargs)


def _spacer() -> Callable[..., Any]:
    """`_call` with ``_SPACER_SLOTS`` unused locals: same bytecode, a bigger frame."""
    code = _call.__code__
    names = code.co_varnames + tuple(f"_pad{i}" for i in range(_SPACER_SLOTS))
    spaced = code.replace(co_varnames=names, co_nlocals=len(names))
    return type(_call)(spaced, _call.__globals__, "_call_in_fresh_chunk")


# Only CPython has the chunked data stack; elsewhere the plain call is the same thing.
_CALL = _spacer() if sys.implementation.name == "cpython" and sys.version_info >= (3, 11) else _call


def in_fresh_stack_chunk(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, its frames in a fresh 64 KiB data-stack chunk (see the module docstring)."""
    return _CALL(fn, args, kwargs)
