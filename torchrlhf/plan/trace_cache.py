"""Traced memory kept on disk, so that a model's micro-batch is traced once per machine, not once per plan.

A trace (`torchrlhf.trainer.memory`) costs seconds and a plan asks for tens of them; the same ones come back when a
user plans the same config again, for another cluster size or another hardware profile of the same device type. So
`cached` keeps each result as a small JSON file under ``$TORCHRLHF_PLAN_CACHE`` (default
``~/.cache/torchrlhf/plan``; an empty value turns the cache off), named by a hash of everything the trace depends on:
the model's ``config.json`` text, the trace's arguments, the torch and transformers versions, and the source of the
``torchrlhf`` package itself, so an edit to a model or to the tracer starts a fresh set instead of reading stale
numbers. A file that cannot be read is traced again and rewritten; files are written whole (a temporary name,
then renamed), so a killed plan never leaves half a result.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import transformers

from torchrlhf.models.loading import USER_CACHE, user_cache_path

T = TypeVar("T")

ENV = "TORCHRLHF_PLAN_CACHE"


def plan_cache_root() -> Path | None:
    """Where traces are kept, or None (``TORCHRLHF_PLAN_CACHE=""``: no disk cache)."""
    return user_cache_path(ENV, USER_CACHE / "plan")


@functools.lru_cache(maxsize=1)
def _code_version() -> str:
    """A hash of the package's Python source and of the libraries that shape a trace."""
    h = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def cached(model_path: str, what: str, args: tuple, trace: Callable[[], dict[str, Any]],
           read: Callable[[dict[str, Any]], T] = lambda kept: kept) -> T:
    """``read(trace())`` (``trace``: a JSON object, bytes of ``model_path``'s architecture by phase and kind), the
    object read from the disk cache when this machine traced the same ``what`` and ``args`` before. ``args``'
    ``repr`` must name every argument. A file ``read`` refuses (TypeError, ValueError, KeyError: a hand edit,
    another layout) is traced again and rewritten, as a torn one is."""
    root = plan_cache_root()
    config = Path(model_path) / "config.json"
    if root is None or not config.is_file():
        return read(trace())
    key = hashlib.sha256(json.dumps([_code_version(), config.read_text(), what, repr(args)]).encode()).hexdigest()
    path = root / key[:2] / f"{key}.json"
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict):
            return read(kept)
    except (OSError, ValueError, TypeError, KeyError):
        pass
    result = trace()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump(result, f)
        os.replace(f.name, path)
    except OSError:  # a read-only or full disk costs the cache, not the plan
        pass
    return read(result)


__all__ = ["ENV", "cached", "plan_cache_root"]
