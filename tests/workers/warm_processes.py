"""Test processes forked from one that has imported torch, transformers and the recipe once.

A rank of ``recipes/ppo.py`` spends ~9 s of CPU importing torch, transformers and
torchrlhf before it does anything: most of a tiny test run, and on the CI host's two cores the ranks of one
test import side by side with another test's. `WARM` is a multiprocessing *forkserver* context whose server
imported this module, and with it the recipe, once per test process: a process it starts is what a fresh one
would be after those imports (the server is a single-threaded interpreter that only imported).
`start_rank` starts a rank of the recipe (or of another script) with it, which sets the environment it is
given, redirects its output to files and runs the command line; `run_forked` starts a job's ranks and waits for
them. There is one forkserver per process, and the first module to start it chooses what it preloads
(`torchrlhf.utils.isolated` preloads itself when it starts it), so the recipe tests' conftest starts it
(`start_server`) as pytest collects, before any test runs.

The ranks rendezvous as ``srun`` starts them (``env://``, no torchrun agent: the process group's store at
MASTER_PORT, RPC's at the next port), a launch the recipe supports. What torchrun's agent itself does (restarts,
killing the other ranks when one fails) is tested through torchrun (``run_recipe(..., torchrun=True)``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import recipes.ppo  # noqa: E402  (what every rank would import: the reason this module exists)

RECIPE = ROOT / "recipes" / "ppo.py"

WARM = multiprocessing.get_context("forkserver")
WARM.set_forkserver_preload([__name__])


def start_server() -> None:
    """Start the forkserver with this module preloaded.

    The server is a fresh interpreter that imports the preload list by name and skips a name it cannot
    import, silently. Python 3.11 passes it the caller's ``sys.path`` but does not apply it, so this module's
    folder, which pytest only added to its own ``sys.path``, travels in PYTHONPATH. Without it each rank
    imported everything after the fork, ~15 s on the CI host's two cores, and every recipe test paid it.
    """
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), str(ROOT), path]))
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if path is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = path


def start_rank(argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path, script: Path = RECIPE
               ) -> multiprocessing.process.BaseProcess:
    """Start one rank of ``python <script> <argv>`` (the recipe unless told) with environment ``env`` (the
    whole of it) in ``cwd``, its output written to the files ``stdout`` and ``stderr``."""
    start_server()  # a no-op once it runs; a test file run alone may come here first
    process = WARM.Process(target=_rank_main, args=(str(script), argv, env, str(cwd), str(stdout), str(stderr)),
                           name=f"{script.stem}-rank-{env.get('RANK', '0')}")
    process.start()
    return process


def one_node(nproc: int, env: dict[str, str], port: int) -> list[dict[str, str]]:
    """Each rank's environment: ``env`` with torchrun's variables for ``nproc`` ranks on one node, their stores
    at ``port`` and the next (the process group's and RPC's); one process: none of them, as ``python`` runs it."""
    if nproc == 1:
        return [env]
    job = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    return [{**env, **job, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(nproc)]


def run_forked(argv: list[str], envs: list[dict[str, str]], cwd: Path, timeout: float, *, script: Path = RECIPE,
               end_all_on_failure: bool, grace: float = 0.0, joined: bool = True):
    """Start one rank of ``python <script> <argv>`` per environment (`start_rank`) and wait for all of them
    (killed past ``timeout``, which then raises `subprocess.TimeoutExpired` as `subprocess.run` does).

    ``end_all_on_failure``: ``grace`` seconds after a rank fails, the others are stopped (SIGTERM, then SIGKILL),
    as torchrun's agent does at its next monitor tick. Returns the ranks' outputs joined in rank order with the
    first failed rank's exit code (``joined``), or one answer per rank."""
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        files = [(Path(tmp) / f"{rank}.out", Path(tmp) / f"{rank}.err") for rank in range(len(envs))]
        for path in (p for pair in files for p in pair):
            path.touch()  # a rank that fails before its redirect (it cannot start) leaves them empty
        procs = [start_rank(argv, env, cwd, out, err, script) for env, (out, err) in zip(envs, files)]
        deadline, failed_since, stopping_since, first_failure = time.monotonic() + timeout, None, None, 0
        try:
            while running := [p for p in procs if p.exitcode is None]:
                if time.monotonic() > deadline:
                    for rank, (out, err) in enumerate(files):  # what the ranks said: where it hung
                        said = out.read_text()[-3000:] + err.read_text()[-6000:]
                        print(f"--- rank {rank} before the timeout:\n{said}", file=sys.stderr)
                    raise subprocess.TimeoutExpired([str(script), *argv], timeout)
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                first_failure = first_failure or (failed[0] if failed else 0)
                if failed and failed_since is None:
                    failed_since = time.monotonic()
                if (end_all_on_failure and failed_since is not None and stopping_since is None
                        and time.monotonic() - failed_since >= grace):
                    stopping_since = time.monotonic()
                    for p in running:
                        p.terminate()
                if stopping_since is not None and time.monotonic() - stopping_since > 10:
                    for p in running:
                        p.kill()
                running[0].join(timeout=0.2)
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                p.join()
        answers = [subprocess.CompletedProcess(argv, p.exitcode, out.read_text(), err.read_text())
                   for p, (out, err) in zip(procs, files)]
    if not joined:
        return answers
    code = first_failure or next((a.returncode for a in answers if a.returncode != 0), 0)
    return subprocess.CompletedProcess(argv, code, "".join(a.stdout for a in answers),
                                       "".join(a.stderr for a in answers))


def _rank_main(script: str, argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # What the interpreter would have made of PYTHONPATH and the script's folder at start-up.
    head = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [os.path.dirname(script)]
    sys.path[:0] = [p for p in head if p not in sys.path]
    sys.argv = [script, *argv]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        if script == str(RECIPE):
            recipes.ppo.cli(argv)
        else:
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child leaves by os._exit: run what interpreter exit would
