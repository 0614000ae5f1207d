"""Test processes forked from one that has imported torch, transformers and the recipe once.

A rank of ``recipes/ppo.py`` spends ~9 s of CPU importing torch, transformers and
torchrlhf before it does anything: most of a tiny test run, and on the CI host's two cores the ranks of one
test import side by side with another test's. `WARM` is a multiprocessing *forkserver* context whose server
imported this module, and with it the recipe, once per test process: a process it starts is what a fresh one
would be after those imports (the server is a single-threaded interpreter that only imported).
`start_recipe_rank` starts a rank of the recipe with it, which sets the environment it is given, redirects its
output to files and runs the recipe's command line. There is one forkserver per process, and the first module to
start it chooses what it preloads (`torchrlhf.utils.isolated` preloads itself when it starts it), so the recipe
tests' conftest starts it (`start_server`) as pytest collects, before any test runs.

The ranks rendezvous as ``srun`` starts them (``env://``, no torchrun agent: the process group's store at
MASTER_PORT, RPC's at the next port), a launch the recipe supports. What torchrun's agent itself does (restarts,
killing the other ranks when one fails) is tested through torchrun (``run_recipe(..., torchrun=True)``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import recipes.ppo  # noqa: E402  (what every rank would import: the reason this module exists)

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


def start_recipe_rank(argv: list[str], env: dict[str, str], cwd: Path, stdout: Path, stderr: Path
               ) -> multiprocessing.process.BaseProcess:
    """Start one rank of ``recipes/ppo.py <argv>`` with environment ``env`` (the whole of it) in ``cwd``,
    its output written to the files ``stdout`` and ``stderr``."""
    process = WARM.Process(target=_rank_main, args=(argv, env, str(cwd), str(stdout), str(stderr)),
                               name=f"recipe-rank-{env.get('RANK', '0')}")
    process.start()
    return process


def _rank_main(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    for fd, path in ((1, stdout), (2, stderr)):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # What the interpreter would have made of PYTHONPATH and the script's folder at start-up.
    head = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT / "recipes")]
    sys.path[:0] = [p for p in head if p not in sys.path]
    sys.argv = [str(ROOT / "recipes" / "ppo.py"), *argv]
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    try:
        recipes.ppo.cli(argv)
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child leaves by os._exit: run what interpreter exit would
