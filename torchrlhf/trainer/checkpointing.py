"""Checkpoint directories of a run: naming, completeness, `resume=auto`, retention.

A checkpoint is ``<output_dir>/global_step_<k>/`` holding each role's DCP state
(written by the workers) and ``controller.pt`` (step, sampler, KL controller,
Lagrange multiplier, RNG). It is complete only once the ``COMPLETE`` marker is
written, last; `resume=auto` never picks a directory without it, so a run killed
mid-save resumes from the previous checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointManager:
    def __init__(self, output_dir: str, keep_last: int | None = None) -> None:
        self.output_dir = output_dir
        self.keep_last = keep_last

    def path_for(self, step: int) -> str:
        return os.path.join(self.output_dir, f"global_step_{step}")

    def save(self, step: int, save_roles: Callable[[str], None], controller_state: dict[str, Any]) -> str:
        """Write the roles' state and the controller's, then mark the directory complete.

        A failed save (a full disk, a dying worker) leaves this directory incomplete, which `resume=auto`
        skips; the error names the directory and the complete checkpoint a resume would use.
        """
        path = self.path_for(step)
        try:
            if os.path.exists(path):
                shutil.rmtree(path)  # an earlier, unfinished attempt at this step
            os.makedirs(path)
            save_roles(path)
            torch.save(controller_state, os.path.join(path, "controller.pt"))
            with open(os.path.join(path, COMPLETE), "w") as f:
                f.write(f"{step}\n")
        except Exception as e:
            previous = [p for s, p in self.complete_checkpoints() if s != step]
            keep = f"the latest complete checkpoint, {previous[-1]}, is intact" if previous else \
                "there is no earlier complete checkpoint"
            raise RuntimeError(f"saving checkpoint {path} failed ({type(e).__name__}: {e}); it is left incomplete "
                               f"and resume=auto skips it; {keep}") from e
        self._prune()
        return path

    def complete_checkpoints(self) -> list[tuple[int, str]]:
        """(step, path) of every complete checkpoint, oldest first."""
        if not os.path.isdir(self.output_dir):
            return []
        found = []
        for name in os.listdir(self.output_dir):
            m = _STEP_DIR.match(name)
            path = os.path.join(self.output_dir, name)
            if m and os.path.exists(os.path.join(path, COMPLETE)):
                found.append((int(m.group(1)), path))
        return sorted(found)

    def resolve(self, resume: str) -> str | None:
        """The checkpoint to resume from: ``auto`` = latest complete, ``disable`` = none, else a path."""
        if resume == "disable":
            return None
        if resume == "auto":
            found = self.complete_checkpoints()
            return found[-1][1] if found else None
        if not os.path.exists(os.path.join(resume, COMPLETE)):
            raise FileNotFoundError(f"trainer.checkpoint.resume={resume!r} is not a complete checkpoint (no {COMPLETE} marker)")
        return resume

    @staticmethod
    def load_controller_state(path: str) -> dict[str, Any]:
        file = os.path.join(path, "controller.pt")
        try:
            return torch.load(file, weights_only=True)
        except Exception as e:
            raise RuntimeError(f"checkpoint file {file} is unreadable ({type(e).__name__}: {e}); it may be "
                               "corrupted: resume from an earlier checkpoint (trainer.checkpoint.resume=<its path>)") from e

    def _prune(self) -> None:
        if not self.keep_last:
            return
        for _, path in self.complete_checkpoints()[: -self.keep_last]:
            shutil.rmtree(path, ignore_errors=True)
