"""Readings of this host's hardware, kept on disk so that each is measured once per host, not once per process.

Without it every rank of every run measures the matmul peak (the MFU denominator) at start: seconds in float32,
minutes in bf16 on a CPU without bf16 instructions, and ranks started together measure at once and slow each
other's reading. The readings live in one JSON file; a lock beside it lets the first process measure while the
others wait for its value.

The file is ``$TORCHRLHF_CALIBRATION`` when set (an empty value keeps nothing on disk: every process measures),
else ``~/.cache/torchrlhf/calibration.json``. A reading stays until its entry (or the file) is deleted, so one
taken on a busy host stays low; ``trainer.peak_flops`` sets the peak outright.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

from torchrlhf.models.loading import USER_CACHE, user_cache_path

ENV = "TORCHRLHF_CALIBRATION"


def calibration_file() -> Path | None:
    """Where readings are kept, or None (``TORCHRLHF_CALIBRATION=""``): measure in every process."""
    return user_cache_path(ENV, USER_CACHE / "calibration.json")


def device_name(device: torch.device) -> str:
    """The device's model name: the GPU's, or the CPU's (its readings differ by model, not by machine)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measured(key: str, measure: Callable[[], float]) -> float:
    """The reading stored under ``key``, else ``measure()`` stored there. Processes on one host measure one at a
    time, so a reading is never taken while another process of ours takes one."""
    path = calibration_file()
    if path is None:
        return measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        readings = _read(path)
        if key not in readings:
            readings[key] = float(measure())
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(readings, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half of one
        return readings[key]


def _read(path: Path) -> dict[str, float]:
    if not path.exists():
        return {}
    try:
        readings = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not a calibration file ({e}); delete it to measure again (${ENV} moves it)") from e
    if not isinstance(readings, dict) or not all(isinstance(v, (int, float)) for v in readings.values()):
        raise ValueError(f"{path}: expected an object of numbers; delete it to measure again (${ENV} moves it)")
    return readings


__all__ = ["ENV", "calibration_file", "device_name", "measured"]
