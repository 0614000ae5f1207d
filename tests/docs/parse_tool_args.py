"""Parse documented tool commands with each tool's own argparse parser, without running the tool.

Reads a JSON list of ``[where, script, args]`` on stdin and prints one JSON line: the same entries with a
fourth item, None when the tool's parser took the arguments, else what went wrong. Each script runs as
``__main__`` up to its ``parse_args`` call, which parses and then stops it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import runpy
import sys


class _Parsed(Exception):
    """Raised right after a successful parse: the tool's work is not run."""


_parse_args = argparse.ArgumentParser.parse_args


def _parse_then_stop(self, args=None, namespace=None):
    _parse_args(self, args, namespace)  # a bad flag: SystemExit(2) with argparse's message on stderr
    raise _Parsed


def check(script: str, args: list[str]) -> str | None:
    sys.argv = [script, *args]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
    except _Parsed:
        return None
    except SystemExit as e:
        return f"its parser refused the arguments (exit {e.code}): {err.getvalue().strip()[-400:]}"
    except Exception as e:
        return f"{type(e).__name__} before its arguments were parsed: {e}"
    return "it never called ArgumentParser.parse_args (give it an argparse parser)"


def main() -> None:
    argparse.ArgumentParser.parse_args = _parse_then_stop
    results = [[where, script, args, check(script, args)] for where, script, args in json.load(sys.stdin)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
