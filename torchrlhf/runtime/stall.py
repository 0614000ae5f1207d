"""The stall doctor: when a worker call runs too long, say who waits on whom, with every rank's stack.

Worker side: each rank records the calls it is running (group, method, start) as `_invoke` enters and
leaves them, and the seconds each method has taken (`busy_seconds`). `status` is an RPC target that a
free RPC thread answers even while those calls are stuck in a collective (gloo and NCCL waits release
the GIL): every running call, how long it has run, the `torch.distributed` call it is blocked in (if any)
and its Python stack.

Controller side: `GroupFuture.wait` gives a call ``stall_timeout`` seconds (`set_stall_timeout`, from
``trainer.stall_timeout_s``); past it, `report` asks every rank for its status and `StallError` carries
the report. The recipe then ends the job as for any error, so no one waits for an RPC timeout.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

import torch.distributed as dist
import torch.distributed.rpc as rpc

from torchrlhf.runtime.launch import worker_name

_running: dict[int, tuple[str, str, float]] = {}  # thread id -> (group, method, perf_counter at start)
_finished: dict[str, dict[str, float]] = {}  # group -> method -> seconds of the calls that ended
_lock = threading.Lock()  # a call moves from running to finished atomically: no moment counts it twice or never
_timeout: float | None = None
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


class StallError(RuntimeError):
    """A worker call ran past the stall timeout; the message is the report."""


def set_stall_timeout(seconds: float | None) -> None:
    """Controller side: how long one worker call may run before the stall report (None or <= 0: never)."""
    global _timeout
    _timeout = seconds if seconds and seconds > 0 else None


def stall_timeout() -> float | None:
    return _timeout


# ---------------------------------------------------------------------- worker side
def enter(group: str, method: str) -> None:
    with _lock:
        _running[threading.get_ident()] = (group, method, time.perf_counter())


def leave() -> None:
    with _lock:
        group, method, start = _running.pop(threading.get_ident())
        seconds = _finished.setdefault(group, {})
        seconds[method] = seconds.get(method, 0.0) + time.perf_counter() - start


def busy_seconds(group: str) -> tuple[float, dict[str, float]]:
    """This rank's clock (``time.perf_counter``) and the seconds it has spent inside each method of worker
    ``group`` up to that moment, running calls included.

    The controller's wall time of a call minus these seconds is what dispatch, RPC and serialization cost. The
    clock comes with them so that a busy fraction divides by this process's own interval: the controller's
    clock would not do, as a request delayed on its way makes the rank's interval longer than the controller's.
    """
    with _lock:
        now = time.perf_counter()
        out = dict(_finished.get(group, {}))
        for name, method, start in _running.values():
            if name == group:
                out[method] = out.get(method, 0.0) + now - start
    return now, out


def forget_busy() -> None:
    """At runtime shutdown: the next run counts from zero."""
    with _lock:
        _finished.clear()


def _blocked_in(frame: Any) -> str | None:
    """The ``torch.distributed`` call the stack ends in (the outermost frame of its innermost run of
    ``torch/distributed`` frames), with the line of ours that made it; None when it ends elsewhere."""
    entries = traceback.extract_stack(frame)
    i = len(entries)
    while i > 0 and _DISTRIBUTED in entries[i - 1].filename:
        i -= 1
    if i == len(entries) or i == 0:
        return None
    names = [e.name for e in entries[i:] if e.name not in ("wrapper", "inner")]  # skip logging decorators
    caller = entries[i - 1]
    return f"{names[0] if names else entries[i].name} (from {caller.filename}:{caller.lineno} in {caller.name}: " \
           f"{caller.line})"


def status() -> dict[str, Any]:
    """RPC target: this rank's running calls, each with seconds, the collective it waits in, its stack."""
    frames = sys._current_frames()
    now = time.perf_counter()
    with _lock:
        running = list(_running.items())
    calls = []
    for tid, (group, method, start) in running:
        frame = frames.get(tid)
        calls.append({
            "call": f"{group}.{method}", "seconds": now - start,
            "blocked_in": _blocked_in(frame) if frame is not None else None,
            "stack": "".join(traceback.format_stack(frame)) if frame is not None else "",
        })
    return {"rank": dist.get_rank(), "calls": calls}


# ---------------------------------------------------------------------- controller side
def report(waiting_for: str, seconds: float, answer_timeout: float = 10.0) -> str:
    """Ask every rank what it is doing and write who waits on whom (collectives vs the rest), then stacks."""
    world = dist.get_world_size()
    futures = [rpc.rpc_async(worker_name(r), status, timeout=answer_timeout) for r in range(world)]
    lines = [f"torchrlhf stall report: {waiting_for} has run {seconds:.1f} s (trainer.stall_timeout_s)"]
    waiting, elsewhere, stacks = [], [], []
    for r, fut in enumerate(futures):
        try:
            calls = fut.wait()["calls"]
        except Exception as e:  # noqa: BLE001 - a dead or saturated rank is part of the diagnosis
            lines.append(f"  rank {r}: did not answer ({type(e).__name__}: its process died, or every RPC "
                         "thread is busy)")
            elsewhere.append(r)
            continue
        if not calls:
            lines.append(f"  rank {r}: idle (no call running)")
            elsewhere.append(r)
        for c in calls:
            where = f"blocked in {c['blocked_in']}" if c["blocked_in"] else "not in a collective"
            lines.append(f"  rank {r}: {c['call']} for {c['seconds']:.1f} s, {where}")
            stacks.append(f"--- rank {r}, {c['call']}:\n{c['stack'].rstrip()}")
        if calls and any(c["blocked_in"] for c in calls):
            waiting.append(r)
        elif calls:
            elsewhere.append(r)
    if waiting and elsewhere:
        lines.append(f"  ranks {waiting} wait in a collective that ranks {elsewhere} have not entered")
    elif waiting:
        lines.append(f"  ranks {waiting} all wait in collectives: mismatched collectives or a slow peer")
    return "\n".join(lines + ["stacks:"] + stacks)
