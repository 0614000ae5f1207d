import resource
import sys

import pytest

from torchrlhf.utils.pystack import in_fresh_stack_chunk

CALLS = 400


def _leaf(x: int) -> int:
    return x + 1


def _loop() -> int:
    total = 0
    for i in range(CALLS):
        total = _leaf(total)
    return total


def _at_depth(depth: int, fn):
    """``fn()`` called ``depth`` small frames below here."""
    if depth == 0:
        return fn()
    return _at_depth(depth - 1, fn)


def _faults(depth: int, fn) -> int:
    """Minor page faults while ``fn`` runs ``depth`` frames deep: a loop whose calls open and free a data-stack
    chunk faults in a fresh mapping on every call."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert _at_depth(depth, fn) == CALLS
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_passes_arguments_results_and_exceptions():
    assert in_fresh_stack_chunk(lambda a, b=0: a * 10 + b, 4, b=2) == 42
    with pytest.raises(KeyError, match="x"):
        in_fresh_stack_chunk({}.__getitem__, "x")


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's chunked data stack")
def test_a_loop_in_a_fresh_chunk_never_crosses_a_chunk_boundary():
    # Depths spanning more than one 16 KiB chunk of `_at_depth` frames: at some depth the plain loop's calls
    # cross a boundary (the CPython behaviour the helper exists for); from a fresh chunk none does.
    depths = range(0, 400, 1)
    plain = max(_faults(d, _loop) for d in depths)
    if plain < CALLS:
        pytest.skip("this CPython caches a freed data-stack chunk (python/cpython#142183 fixed): nothing to avoid")
    spaced = max(_faults(d, lambda: in_fresh_stack_chunk(_loop)) for d in depths)
    assert spaced < CALLS // 10, (plain, spaced)
