"""End-to-end runtime tests: real torchrun jobs (gloo, CPU) running tests/runtime/scenarios.py.

Each torchrun launch groups several scenarios to keep the suite fast; the
scenarios assert against hand-derived values on the controller and print
``PASS ...`` lines. Every launch has a subprocess timeout so nothing can hang.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "workers"))
from dist_helpers import free_port  # noqa: E402

SCENARIOS = Path(__file__).with_name("scenarios.py")


def _env() -> dict[str, str]:
    torchrun_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in torchrun_vars}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    return env


def _torchrun(
    nproc: int, *args: str, monitor_interval: float | None = None, timeout: float = 150
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if monitor_interval is not None:
        cmd.append(f"--monitor-interval={monitor_interval}")
    cmd += [str(SCENARIOS), *args]
    return subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_placement_colocation(world: int, tmp_path: Path) -> None:
    p = _torchrun(world, "all", str(tmp_path))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    expected = ["one_to_all", "dp_compute", "async", "misuse", "worker error", "colocation", "ALL PASSED"]
    if world == 4:
        expected += ["tp routing", "device mesh", "split placement concurrency"]
    for marker in expected:
        assert marker in p.stdout, f"missing {marker!r}:\n{out}"


def test_main_raises_every_rank_exits_nonzero() -> None:
    # Bounded time: the subprocess timeout; a hang would raise TimeoutExpired.
    p = _torchrun(2, "error", timeout=90)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "PASS call timeout" in p.stdout, out
    assert "torchrlhf.runtime.futures.WorkerError: worker group 'doomed', method 'fail_on' failed on rank 1" in out, out
    assert "ValueError: planned failure on rank 1" in out, out
    assert "rank 1 stopping with exit code 1" in out, out  # our stop, not torchrun's SIGTERM


def test_killed_worker_fails_controller_and_stops_the_rest() -> None:
    # A longer monitor interval keeps torchrun's own teardown from racing ours, so the
    # test sees the controller's error and the runtime stopping the surviving rank 2.
    p = _torchrun(3, "kill", monitor_interval=5, timeout=90)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "CAUGHT worker group 'victim', method 'die_on' failed on rank 1" in out, out
    assert "did not answer" in out, out
    assert "rank 2 stopping with exit code 1" in out, out


def test_a_lost_replica_is_dropped_and_the_rest_go_on(tmp_path: Path) -> None:
    """Each rank its own process (as srun starts them; one torchrun agent would stop all when one dies):
    rank 2 is killed, the controller drops its replica and goes on, and ranks 0 and 1 exit 0."""
    port = free_port(span=2)  # the process group's store and RPC's (port + 1)
    procs = []
    for rank in range(3):
        env = {**_env(), "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(SCENARIOS), "lose"], env=env, cwd=ROOT, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    try:
        codes = [p.wait(timeout=120) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            log.close()
    out = (tmp_path / "rank0.log").read_text()
    assert codes == [0, 0, -9], (codes, out, (tmp_path / "rank1.log").read_text())
    assert "PASS lost replica" in out, out
    assert "LOST group 'pair' replica 1 (ranks [2])" in out, out


def test_stall_report_names_who_waits_on_whom_and_ends_the_job() -> None:
    """Rank 1 sleeps instead of joining the all-reduce ranks 0 and 2 wait in: 3 s into the call the controller
    prints each rank's call, the collective it is blocked in and its stack, then the job ends."""
    p = _torchrun(3, "stall", monitor_interval=5, timeout=90)
    out = p.stdout + p.stderr
    assert p.returncode != 0, out
    assert "torchrlhf stall report: hang.reduce_except_on has run 3.0 s" in out, out
    assert re.search(r"rank 0: hang.reduce_except_on for 3\.\d s, blocked in all_reduce \(from .*scenarios.py", out), out
    assert re.search(r"rank 1: hang.reduce_except_on for 3\.\d s, not in a collective", out), out
    assert "ranks [0, 2] wait in a collective that ranks [1] have not entered" in out, out
    assert "time.sleep(120)" in out  # rank 1's stack shows where it is
    assert "woke from its sleep" not in out  # ended by the report, before the sleep or any RPC timeout


NOTEBOOK = """
import sys, torch
from torchrlhf.data import Batch
from torchrlhf.runtime import Dispatch, Worker, WorkerError, WorkerGroup, launch, register

class Echo(Worker):
    @register(Dispatch.DP_COMPUTE)
    def double(self, b):
        out = b.copy(); out["y"] = b["x"] * 2; return out
    @register(Dispatch.ONE_TO_ALL)
    def where(self):
        return self.rank, self.ranks, self.process_group is not None
    @register(Dispatch.ONE_TO_ALL)
    def boom(self):
        raise KeyError("nope")

def main(k):
    g = WorkerGroup(Echo, name="echo")
    assert g.where() == [(0, [0], True)]
    assert g.double(Batch({"x": torch.arange(3)}))["y"].tolist() == [0, 2, 4]
    try:
        g.boom()
    except WorkerError as e:
        assert "KeyError: 'nope'" in str(e) and "rank 0" in str(e)
    from torchrlhf.runtime.stall import busy_seconds  # the worker side of this (notebook) process
    _, busy = busy_seconds("echo")
    assert set(busy) == {"where", "double", "boom"} and all(0 < t < 5 for t in busy.values()), busy
    return k

assert launch(main, 7) == 7
assert launch(main, 8) == 8  # init/shutdown can be repeated in one process; names are per run
print("NOTEBOOK OK")
"""


def test_notebook_mode_single_process() -> None:
    cmd = [sys.executable, "-c", NOTEBOOK]
    p = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "NOTEBOOK OK" in p.stdout, p.stdout + p.stderr


TUNING = r"""
import ctypes, os, torch
from torchrlhf.runtime import launch

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2

def mmapped_while_holding(nbytes):
    t = torch.empty(nbytes // 4, dtype=torch.float32)
    held = libc.mallinfo2().hblkhd
    del t
    return held

def threads():
    return {open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")}

print("BEFORE", mmapped_while_holding(64 << 20))

def main():
    print("DURING", mmapped_while_holding(64 << 20), sorted(threads()))

launch(main)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc and /proc are Linux's")
def test_launch_keeps_big_blocks_in_the_heap_and_runs_no_polling_rpc_thread() -> None:
    """A 64 MB tensor is mmapped by default glibc; under `launch` it comes from the heap, and RPC runs no
    shared-memory reactor (the thread that busy-polls a core)."""
    p = subprocess.run([sys.executable, "-c", TUNING], env=_env(), cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    before = int(re.search(r"BEFORE (\d+)", p.stdout).group(1))
    during, names = re.search(r"DURING (\d+) (.*)", p.stdout).groups()
    assert before >= 64 << 20, p.stdout  # glibc's default: a block this big is its own mapping
    assert int(during) < 64 << 20, p.stdout
    assert "TP_SHM_reactor" not in names and "TP_UV_loop" in names, names
