"""`runtime.profiling`: a step's calls, each recorded in the thread that runs it, merged into one trace and table."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from torchrlhf.runtime import profiling


def _in_thread(fn):
    """``fn()`` on a thread of its own (as a worker call runs on the compute thread); returns its result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn()))
    t.start()
    t.join()
    return out["value"]


def test_calls_of_a_step_merge_into_one_trace_and_table(tmp_path):
    x = torch.randn(32, 32)
    assert profiling.record("actor", "update", lambda: 1) == 1  # not profiled: nothing recorded, nothing kept
    profiling.start("actor", 3, 7, str(tmp_path))
    assert _in_thread(lambda: profiling.record("actor", "compute_log_prob", lambda: (x @ x).sum().item())) is not None
    _in_thread(lambda: profiling.record("actor", "update", lambda: x @ x))
    profiling.record("ref", "compute_ref_log_prob", lambda: x @ x)  # another role, not profiled
    paths = profiling.stop("actor")
    assert paths == [str(tmp_path / "step_7" / "actor_rank3.json"), str(tmp_path / "step_7" / "actor_rank3.txt")]
    names = [e.get("name") for e in json.loads(open(paths[0]).read())["traceEvents"]]
    assert names.count("actor.compute_log_prob") == 1 and names.count("actor.update") == 1
    assert "ref.compute_ref_log_prob" not in names
    assert names.count("aten::mm") == 2
    table = open(paths[1]).read()
    assert "2 calls recorded (compute_log_prob, update)" in table
    assert "actor.update " not in table  # the calls' spans are in the trace, the table lists ops
    mm_row = next(line for line in table.splitlines() if line.strip().startswith("aten::mm "))
    assert mm_row.split()[-1] == "2"  # # of Calls, summed over the two sessions
    assert profiling.stop("actor") == []  # stopped already


def test_a_call_overlapping_a_recorded_one_runs_unrecorded(tmp_path):
    profiling.start("actor", 0, 1, str(tmp_path))
    profiling.start("rollout", 0, 1, str(tmp_path))
    inside, release = threading.Event(), threading.Event()

    def long_call():
        inside.set()
        release.wait()
        return torch.ones(2).sum()

    t = threading.Thread(target=profiling.record, args=("actor", "update", long_call))
    t.start()
    inside.wait()
    assert profiling.record("rollout", "generate", lambda: 5) == 5  # torch allows one session per process
    release.set()
    t.join()
    profiling.stop("actor")
    rollout_table = open(profiling.stop("rollout")[1]).read()
    assert "0 calls recorded" in rollout_table and "not recorded (they overlapped another recorded call): generate" \
        in rollout_table
    assert "1 calls recorded (update)" in open(tmp_path / "step_1" / "actor_rank0.txt").read()


def test_a_second_start_before_stop_is_an_error(tmp_path):
    profiling.start("critic", 0, 1, str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="critic: step 1 is still being profiled"):
            profiling.start("critic", 0, 2, str(tmp_path))
    finally:
        profiling.stop("critic")
