"""The calibration file: a reading is measured once per host, by one process while the others wait, and kept."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchrlhf.utils import calibration


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "calibration.json"
    monkeypatch.setenv(calibration.ENV, str(path))
    return path


def test_a_reading_is_measured_once_and_kept(store):
    calls = []
    assert calibration.measured("probe", lambda: calls.append(1) or 2.5) == 2.5
    assert calibration.measured("probe", lambda: calls.append(1) or 9.0) == 2.5
    assert calls == [1]
    assert json.loads(store.read_text()) == {"probe": 2.5}


def test_an_empty_setting_keeps_nothing_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.ENV, "")
    assert calibration.calibration_file() is None
    values = iter([1.0, 2.0])
    assert [calibration.measured("probe", lambda: next(values)) for _ in range(2)] == [1.0, 2.0]


def test_a_corrupt_file_is_named(store):
    store.write_text("{not json")
    with pytest.raises(ValueError, match=f"{store.name}: not a calibration file.*delete it"):
        calibration.measured("probe", lambda: 1.0)
    store.write_text('{"probe": "fast"}')
    with pytest.raises(ValueError, match="expected an object of numbers"):
        calibration.measured("probe", lambda: 1.0)


def _measure_slowly(log: str) -> float:
    with open(log, "a") as f:
        f.write("start\n")
    time.sleep(0.5)  # long enough that an unlocked second process would start its own reading meanwhile
    with open(log, "a") as f:
        f.write("end\n")
    return 7.0


def _reader(path: str, log: str, queue) -> None:
    import os

    os.environ[calibration.ENV] = path
    queue.put(calibration.measured("probe", lambda: _measure_slowly(log)))


def test_processes_started_together_measure_once(tmp_path):
    path, log = str(tmp_path / "c.json"), str(tmp_path / "log")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(path, log, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert got == [7.0] * 3
    assert Path(log).read_text() == "start\nend\n"  # one reading, whichever process took it


def test_the_peak_is_read_from_the_file(store):
    """The matmul peak is kept under the device, dtype, threads and torch version; a kept value is used as is
    (in a fresh process: this one may have read the peak already)."""
    key = (f"matmul_peak/{calibration.device_name(torch.device('cpu'))}/torch.float32/threads=1/"
           f"torch={torch.__version__}")
    store.write_text(json.dumps({key: 123e9}))
    code = ("import torch; torch.set_num_threads(1); from torchrlhf.utils import flops; "
            "print(flops.peak_flops(torch.float32, torch.device('cpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert float(out.stdout) == 123e9
