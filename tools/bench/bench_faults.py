"""Recovery from a killed rank, measured as effective training time (ByteRobust's ETTR): the main job under
``torchrun --max-restarts`` with a rank SIGKILLed every ``--every`` steps.

    python tools/bench/bench_faults.py [--steps 25 --every 10 --rank 1] [--recovery disk|memory|both] [--nodes 2 --lose-node]
        [-- key=value ...]

Runs ``recipes/configs/grpo_arithmetic_cpu.yaml`` (SmolLM2-135M, 2 ranks) under one of two recoveries:

- ``disk``: a disk checkpoint every step (``trainer.checkpoint.save_freq=1``); a restart resumes from the last
  complete one;
- ``memory``: a memory snapshot every step (``snapshot_freq=1``, `torchrlhf.utils.snapshot`) and a disk
  checkpoint every ``--every`` steps; a restart resumes from the snapshot.

``--nodes 2`` runs the ranks as two simulated nodes on this machine (one torchrun agent each, meeting at a c10d
rendezvous), memory recovery keeping each snapshot on the other node too (``snapshot_peer``); ``--lose-node``
deletes the killed rank's node's snapshot part with the kill, so the restart needs the copy:

    python tools/bench/bench_faults.py --recovery memory --nodes 2 --lose-node

Whenever the run's ``metrics.jsonl`` reaches a multiple of ``--every`` steps, the bench kills
``--rank`` (found through ``/proc``: the process whose environment has that ``RANK`` and this run's output
directory on its command line) with SIGKILL, as the out-of-memory killer would.

Each recovery is split by what the bench sees, time-stamped as it happens:

- detection: the kill to torchrun's agent reporting the failed worker group;
- restart to resume: that report to the recipe's ``torchrlhf: resumed from`` line, split into the state load
  (the seconds that line reports) and everything before it (new processes start and import, rendezvous, the
  worker groups and models build);
- re-warm: that line to the start of the first step after it (its metrics line's time minus its
  ``timing_s/step`` and its saves' ``timing_s/save_snapshot`` and ``timing_s/save_checkpoint``, which come
  before the line);

and the steps of work lost (steps that had run and ran again). ETTR is the sum of the kept steps'
``timing_s/step`` over the wall time from launch to exit, the start-up included (a run without faults
has an ETTR below 1 too: it is printed for reference with ``--baseline``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rank_pid(rank: int, marker: str) -> int | None:
    """The pid of the recipe process with ``RANK=rank`` whose command line holds ``marker`` (Linux /proc)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if marker not in cmdline or "ppo.py" not in cmdline or "torch.distributed.run" in cmdline:
                continue
            environ = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(name)
    return None


def process_env(pid: int) -> dict[str, str]:
    """A process's environment (Linux /proc); empty once it is gone."""
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def run(out: Path, args, faults: bool, recovery: str) -> dict:
    shm = Path("/dev/shm") / f"torchrlhf-bench-faults-{os.getpid()}" / out.name
    saves = (["trainer.checkpoint.save_freq=1"] if recovery == "disk" else
             [f"trainer.checkpoint.save_freq={args.every}", "trainer.checkpoint.snapshot_freq=1",
              f"trainer.checkpoint.snapshot_dir={shm}",
              *(["trainer.checkpoint.snapshot_peer=true"] if args.nodes > 1 else [])])
    recipe = [str(ROOT / "recipes/ppo.py"), "--config", str(ROOT / args.config), f"trainer.total_steps={args.steps}",
              *saves, f"trainer.output_dir={out}", "trainer.loggers=[console,jsonl]",
              "trainer.test_freq=0", "trainer.val_before_train=false", *args.overrides]
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--max-restarts={args.max_restarts}"]
    if args.nodes == 1:
        cmds = [[*launcher, "--standalone", f"--nproc_per_node={args.nproc}", *recipe]]
    else:  # one torchrun agent per simulated node, meeting at a c10d rendezvous on this machine
        endpoint = f"127.0.0.1:{29400 + os.getpid() % 1000}"
        cmds = [[*launcher, f"--nnodes={args.nodes}", f"--nproc_per_node={args.nproc // args.nodes}",
                 "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", f"--rdzv_id={out.name}", *recipe]
                for _ in range(args.nodes)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    events: list[tuple[float, str]] = []
    start = time.monotonic()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
             for cmd in cmds]

    def read(proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            now = time.monotonic()
            if "resumed from" in line:
                events.append((now, "resumed"))
            elif "FAILED" in line and "worker group" in line.lower() or "failed (exitcode" in line:
                events.append((now, "detected"))
            events.append((now, "line:" + line.rstrip()))

    readers = [threading.Thread(target=read, args=(proc,), daemon=True) for proc in procs]
    for reader in readers:
        reader.start()
    metrics_file = out / "metrics.jsonl"
    killed_at: set[int] = set()
    kills: list[tuple[float, int]] = []  # (time, steps logged when killed)
    step_seen: list[tuple[float, int]] = []  # (time, step) as each metrics line appears
    while any(proc.poll() is None for proc in procs):
        lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
        steps = [json.loads(line)["step"] for line in lines if line.strip()]
        for s in steps:
            if s not in {x for _, x in step_seen}:
                step_seen.append((time.monotonic(), s))
        last = max(steps, default=0)
        if faults and last and last % args.every == 0 and last < args.steps and last not in killed_at:
            pid = rank_pid(args.rank, str(out))
            if pid is not None:
                node = process_env(pid).get("GROUP_RANK", "0")  # read before the process is gone
                os.kill(pid, signal.SIGKILL)
                kills.append((time.monotonic(), last))
                killed_at.add(last)
                if args.lose_node and recovery == "memory":  # the killed rank's node goes with it: its memory too
                    shutil.rmtree(shm / f"node{node}", ignore_errors=True)
        time.sleep(0.05)
    for reader in readers:
        reader.join(timeout=10)
    wall = time.monotonic() - start
    shutil.rmtree(shm.parent, ignore_errors=True)
    failed = [proc.returncode for proc in procs if proc.returncode != 0]
    if failed:
        tail = "\n".join(text[5:] for _, text in events if text.startswith("line:"))[-4000:]
        raise SystemExit(f"run failed ({failed}):\n{tail}")
    metrics = {json.loads(line)["step"]: json.loads(line) for line in metrics_file.read_text().splitlines()}
    return {"wall": wall, "metrics": metrics, "kills": kills, "events": events, "step_seen": step_seen,
            "start": start}


def logged_after_start(metrics: dict) -> float:
    """Seconds from a step's start to its metrics line: the step, then its snapshot and checkpoint saves (the
    line is written after them)."""
    return sum(metrics.get(f"timing_s/{k}", 0.0) for k in ("step", "save_snapshot", "save_checkpoint"))


def recoveries(result: dict) -> list[dict]:
    """Per kill: detection, restart-to-resume and re-warm seconds, kill to the next step's start, steps lost."""
    out = []
    events = [(t, e) for t, e in result["events"] if not e.startswith("line:")]
    for t_kill, logged in result["kills"]:
        detected = next((t for t, e in events if e == "detected" and t >= t_kill), None)
        resumed = next((t for t, e in events if e == "resumed" and t >= t_kill), None)
        after = [(t, s) for t, s in result["step_seen"] if t > (resumed or t_kill)]
        first = after[0] if after else None
        next_start = first[0] - logged_after_start(result["metrics"][first[1]]) if first else None
        lines = [e[5:] for t, e in result["events"] if e.startswith("line:") and "resumed from" in e and t >= t_kill]
        at = int(lines[0].split(" at step ")[1].split()[0]) if lines and " at step " in lines[0] else None
        load = float(lines[0].split("loaded in ")[1].split()[0]) if lines and "loaded in " in lines[0] else None
        out.append({
            "killed after step": logged,
            "detection_s": (detected - t_kill) if detected else float("nan"),
            "restart_to_resume_s": (resumed - (detected or t_kill)) if resumed else float("nan"),
            "of_it_state_load_s": load if load is not None else float("nan"),
            "rewarm_s": (next_start - resumed) if resumed and next_start else float("nan"),
            "kill_to_next_step_s": (next_start - t_kill) if next_start else float("nan"),
            "steps_lost": (logged - at) if at is not None else float("nan"),
        })
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="recipes/configs/grpo_arithmetic_cpu.yaml")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--every", type=int, default=10, help="kill after every this many steps")
    p.add_argument("--rank", type=int, default=1, help="the rank killed (0 is the controller)")
    p.add_argument("--nproc", type=int, default=2, help="ranks in all")
    p.add_argument("--nodes", type=int, default=1,
                   help="simulated nodes on this machine (one torchrun agent each, c10d rendezvous); with more than "
                        "one, memory recovery keeps each snapshot on another node too (snapshot_peer)")
    p.add_argument("--lose-node", action="store_true",
                   help="memory recovery: the killed rank's node loses its memory too (its snapshot part deleted)")
    p.add_argument("--max-restarts", type=int, default=5)
    p.add_argument("--recovery", choices=["disk", "memory", "both"], default="both")
    p.add_argument("--baseline", action="store_true", help="also run without faults, for the ETTR of start-up")
    p.add_argument("--keep", default=None, help="write the runs here instead of a temporary directory")
    p.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.keep) if args.keep else Path(tmp)
        recoveries_run = ["disk", "memory"] if args.recovery == "both" else [args.recovery]
        sides = [(f"{r}, faults", True, r) for r in recoveries_run]
        sides += [(f"{r}, no faults", False, r) for r in recoveries_run] if args.baseline else []
        print(f"{args.config}, {args.nproc} ranks, {args.steps} steps, rank {args.rank} SIGKILLed after every "
              f"{args.every} steps, torchrun --max-restarts={args.max_restarts}; disk: a checkpoint every step; "
              f"memory: a snapshot every step, a disk checkpoint every {args.every}")
        ettr = {}
        for name, faults, recovery in sides:
            result = run(work / name.replace(" ", "_").replace(",", ""), args, faults, recovery)
            (work / f"{name.replace(' ', '_')}.log").write_text(
                "\n".join(f"{t - result['start']:9.2f} {e}" for t, e in result["events"]))
            productive = sum(m["timing_s/step"] for m in result["metrics"].values())
            ettr[name] = productive / result["wall"]
            saving = sum(m.get("timing_s/save_checkpoint", 0.0) + m.get("timing_s/save_snapshot", 0.0)
                         for m in result["metrics"].values())
            print(f"{name}: wall {result['wall']:.1f} s, productive step time {productive:.1f} s, saving "
                  f"{saving:.1f} s, ETTR {ettr[name]:.3f}, {len(result['kills'])} faults")
            for r in recoveries(result):
                print("  " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
        if "disk, faults" in ettr and "memory, faults" in ettr:
            print(f"ETTR memory {ettr['memory, faults']:.3f} vs disk {ettr['disk, faults']:.3f}")


if __name__ == "__main__":
    main()
