from __future__ import annotations

from concurrent.futures import wait

import pytest

from torchrlhf.utils.isolated import CallTimeout, IsolatedPool


def test_submit_returns_at_once_and_a_hung_call_times_out_while_others_finish(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    (tmp_path / "pool_fns.py").write_text(
        "import os, time\n"
        "def nap(s):\n    time.sleep(s)\n    return s\n"
        "def fail():\n    raise ValueError('bad')\n"
        "def wait_for(path):\n    while not os.path.exists(path):\n        time.sleep(0.01)\n    return path\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with IsolatedPool(num_workers=2, timeout_s=1.5) as pool:
        futures = [pool.submit("pool_fns:nap", (60,)), pool.submit("pool_fns:nap", (0.5,)),
                   pool.submit("pool_fns:fail"), pool.submit("pool_fns:nap", (0.2,), timeout_s=30),
                   pool.submit("pool_fns:wait_for", (str(gate),), timeout_s=60)]
        # Non-blocking: the last call cannot end before the gate exists, and submit has returned.
        assert not futures[4].done()
        gate.touch()
        wait(futures, timeout=120)
        assert isinstance(futures[0].exception(), CallTimeout)  # killed at its 1.5 s, not after its 60 s nap
        assert futures[1].result() == 0.5 and futures[3].result() == 0.2 and futures[4].result() == str(gate)
        assert isinstance(futures[2].exception(), ValueError)
        assert pool.restarts >= 1
        assert pool.submit("pool_fns:nap", (0.0,)).result(timeout=60) == 0.0  # a fresh pool after the kill


def test_unsendable_function_fails_before_anything_runs():
    pool = IsolatedPool()
    with pytest.raises(ValueError, match="cannot be sent to a worker process"):
        pool.run([("os:getpid", (), {}), (lambda: 1, (), {})])
    assert pool._thread is None  # nothing was queued
