"""Calls from many threads run on one compute thread; a call that finds it busy runs at once where it is."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from torchrlhf.runtime import compute_thread


def test_sequential_calls_from_many_threads_share_one_thread():
    with ThreadPoolExecutor(8) as pool:
        names = [pool.submit(compute_thread.run, lambda: threading.current_thread().name).result()
                 for _ in range(16)]
    assert set(names) == {"torchrlhf-compute"}


def test_a_call_that_finds_it_busy_runs_concurrently_on_its_own_thread():
    inside, release = threading.Event(), threading.Event()

    def long_call():
        inside.set()
        assert release.wait(10)
        return threading.current_thread().name

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(compute_thread.run, long_call)
        assert inside.wait(10)
        # runs while the first call is still inside: it does not wait behind it
        second = pool.submit(compute_thread.run, lambda: threading.current_thread().name).result(timeout=10)
        release.set()
        assert first.result(timeout=10) == "torchrlhf-compute"
    assert second.startswith("ThreadPoolExecutor")


def test_errors_reach_the_caller():
    def boom():
        raise KeyError("lost")

    with pytest.raises(KeyError, match="lost"):
        compute_thread.run(boom)
    assert compute_thread.run(lambda: 7) == 7  # the thread survives


def test_reserve_intra_op_threads_leaves_the_caller_one_and_the_compute_thread_the_rest():
    import subprocess
    import sys

    # a fresh process: the reservation changes this process's thread counts for good
    code = (
        "import torch; from torchrlhf.runtime import compute_thread as c\n"
        "torch.set_num_threads(2); c.reserve_intra_op_threads()\n"
        "print(torch.get_num_threads(), c.run(torch.get_num_threads))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["1", "2"]
