"""Start `openenv_echo.py` (openenv-core's own server) on a free loopback port; shared by the OpenEnv tests."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
from dist_helpers import free_port  # noqa: E402, F401  (re-exported: the tests' one port picker)

ECHO = Path(__file__).with_name("openenv_echo.py")


@contextlib.contextmanager
def echo_server(timeout_s: float = 60.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """(base_url, process) of a running echo server; stopped on exit. Waits for ``/health`` up to ``timeout_s``."""
    port = free_port()
    # The server's log goes to a file: a pipe nobody reads while it runs would fill up and block the server.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, str(ECHO), str(port)], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"the echo server did not start: {log.read().decode()[-2000:]}") from None
                time.sleep(0.2)
        yield url, proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        log.close()
