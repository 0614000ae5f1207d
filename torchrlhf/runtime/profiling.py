"""torch.profiler traces of chosen steps, per role and rank, recorded in the thread that computes.

A worker's calls run on its process's compute thread, or on an RPC thread while that one is busy
(`runtime.compute_thread`), and torch.profiler records the thread it was started on (started on another,
Kineto fails with "External init callback must run in same thread as registerClient"). So every call of
a worker whose step is profiled runs inside a profiler session of its own, started and stopped around the
call in the thread that runs it (`record`, from `runtime.registry`). At the step's end `stop` merges the
sessions into one Chrome/Perfetto trace and one key-averages table per role and rank.

Roles colocated in one process take turns (the calls of a synchronous step follow one another), and torch
allows one session per process at a time: a call that overlaps a recorded one (asynchronous training)
runs unrecorded, and the table says how many did.

Controller side, `StepProfiler` tells the chosen roles' workers when a profiled step starts and ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch.autograd.profiler_util import EventList, FunctionEventAvg
from torch.profiler import ProfilerActivity, profile, record_function

T = TypeVar("T")

CONTROL_METHODS = ("start_profile", "stop_profile")  # the profile's own calls, never recorded
TABLE_ROWS = 50


@dataclass
class StepProfile:
    """One role's recording of one step on this rank: the calls' trace events and their op averages."""

    role: str
    rank: int
    step: int
    out_dir: str
    trace: dict[str, Any] = field(default_factory=dict)  # the first call's trace, later calls' events appended
    averages: dict[str, FunctionEventAvg] = field(default_factory=dict)  # op name -> totals over the calls
    calls: list[str] = field(default_factory=list)
    unrecorded: list[str] = field(default_factory=list)  # calls that overlapped another recorded call

    def add(self, method: str, prof: profile) -> None:
        """Fold one call's session into the step's trace and table."""
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        finally:
            os.remove(path)
        if not self.trace:
            self.trace = trace
        else:  # the sessions share one clock; a different base time shifts the events onto the first's
            shift = (trace.get("baseTimeNanoseconds", 0) - self.trace.get("baseTimeNanoseconds", 0)) / 1000
            for event in trace["traceEvents"]:
                if "ts" in event and isinstance(event["ts"], (int, float)):
                    event["ts"] += shift
            self.trace["traceEvents"] += trace["traceEvents"]
        for avg in prof.key_averages():
            if avg.key == f"{self.role}.{method}":  # the call's own span: in the trace, not among the ops
                continue
            if avg.key in self.averages:
                self.averages[avg.key].add(avg)
            else:
                self.averages[avg.key] = avg
        self.calls.append(method)

    def write(self) -> list[str]:
        """``<out_dir>/step_<N>/<role>_rank<R>.json`` (the trace) and ``.txt`` (the table); returns the paths."""
        folder = os.path.join(self.out_dir, f"step_{self.step}")
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, f"{self.role}_rank{self.rank}")
        with open(stem + ".json", "w") as f:
            json.dump(self.trace or {"traceEvents": []}, f)
        device = torch.cuda.is_available()
        sort_by = "self_device_time_total" if device else "self_cpu_time_total"
        header = [f"role {self.role}, rank {self.rank}, step {self.step}: {len(self.calls)} calls recorded "
                  f"({', '.join(self.calls) or 'none'}), sorted by {sort_by}"]
        if self.unrecorded:
            header.append(f"not recorded (they overlapped another recorded call): {', '.join(self.unrecorded)}")
        table = EventList(list(self.averages.values())).table(sort_by=sort_by, row_limit=TABLE_ROWS) \
            if self.averages else "(no calls)\n"
        with open(stem + ".txt", "w") as f:
            f.write("\n".join(header) + "\n\n" + table)
        return [stem + ".json", stem + ".txt"]


_sessions: dict[str, StepProfile] = {}  # worker group name -> its recording in progress (this process)
_lock = threading.Lock()  # guards `_sessions` and a `StepProfile` being added to while another thread stops it
_one_at_a_time = threading.Lock()  # held while a profiler session runs in this process


def start(role: str, rank: int, step: int, out_dir: str) -> None:
    """Worker side: record ``role``'s calls from now on, until `stop`."""
    with _lock:
        if role in _sessions:
            raise RuntimeError(f"{role}: step {_sessions[role].step} is still being profiled (stop_profile first)")
        _sessions[role] = StepProfile(role, rank, step, out_dir)


def stop(role: str) -> list[str]:
    """Worker side: stop recording ``role`` and write its trace and table; returns the paths (none if not started)."""
    with _lock:
        profile_ = _sessions.pop(role, None)
        return profile_.write() if profile_ is not None else []


def record(role: str, method: str, call: Callable[[], T]) -> T:
    """Run ``call`` (the worker method ``role.method``), inside a profiler session if ``role`` is being recorded."""
    profile_ = _sessions.get(role)
    if profile_ is None or method in CONTROL_METHODS:
        return call()
    if not _one_at_a_time.acquire(blocking=False):
        with _lock:
            profile_.unrecorded.append(method)
        return call()
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=activities, acc_events=True) as prof:  # one cycle: acc_events only stops a warning
            with record_function(f"{role}.{method}"):
                out = call()
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the call's kernels end inside the session
        with _lock:
            profile_.add(method, prof)
        return out
    finally:
        _one_at_a_time.release()


class StepProfiler:
    """Controller side: for each of ``steps``, every worker of ``groups`` records its calls of that step.

    Args:
        steps: the global steps to profile (1-based, as logged).
        groups: role name -> its `WorkerGroup`; each rank writes ``<out_dir>/step_<N>/<role>_rank<R>.*``.
        out_dir: where the ranks write (on each rank's own file system).
    """

    def __init__(self, steps: Sequence[int] = (), groups: Mapping[str, Any] | None = None, out_dir: str = "") -> None:
        self.steps, self.groups, self.out_dir = frozenset(steps), dict(groups or {}), out_dir

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: profiled if ``step`` is one of ``steps``."""
        if step not in self.steps or not self.groups:
            yield
            return
        for group in self.groups.values():
            group.start_profile(step, self.out_dir)
        yield  # a step that raises ends the run: its recordings are not written
        for group in self.groups.values():
            group.stop_profile()
