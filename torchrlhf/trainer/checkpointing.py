"""Checkpoint directories of a run: naming, completeness, `resume=auto`, retention.

A checkpoint is ``<output_dir>/global_step_<k>/`` holding each role's DCP state
(written by the workers) and ``controller.pt`` (step, sampler, KL controller,
Lagrange multiplier, RNG). It is complete only once the ``COMPLETE`` marker is
written, last; `resume=auto` never picks a directory without it, so a run killed
mid-save resumes from the previous checkpoint.

`SnapshotManager` is the controller's side of the memory snapshots (`torchrlhf.utils.snapshot`), written every
``snapshot_freq`` steps into node-local shared memory, which a restarted job loads before any disk checkpoint.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from typing import Any

import torch

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def checkpoint_step(path: str) -> int:
    """The step of a checkpoint directory ``global_step_<k>`` (-1 for another name)."""
    m = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else -1


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


class SnapshotManager:
    """Which memory-snapshot slot to write next, publishing it, and whether a restart may resume from it.

    ``<root>/LATEST`` names the published slot, its step and the run's fingerprint (its config and world
    size). It is replaced atomically, and only after every rank wrote the slot and the controller's state is in
    ``<root>/slot<i>/controller.pt``: a snapshot is never half-published. A snapshot with another fingerprint
    is refused (the restart falls back to disk).
    """

    LATEST = "LATEST"

    def __init__(self, root: str, fingerprint: str) -> None:
        self.root = root
        self.fingerprint = fingerprint

    @staticmethod
    def default_root(output_dir: str) -> str:
        """``/dev/shm/torchrlhf/<hash of the output directory>``: node-local memory, one per run directory."""
        key = hashlib.sha256(os.path.abspath(output_dir).encode()).hexdigest()[:16]
        return os.path.join("/dev/shm", "torchrlhf", key)

    def latest(self) -> dict[str, Any] | None:
        """The published snapshot (``step``, ``slot``, ``fingerprint``), or None."""
        try:
            with open(os.path.join(self.root, self.LATEST)) as f:
                latest = json.load(f)
            return {"step": int(latest["step"]), "slot": int(latest["slot"]), "fingerprint": str(latest["fingerprint"])}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def next_slot(self) -> int:
        """The slot that does not hold the published snapshot."""
        latest = self.latest()
        return 1 - latest["slot"] if latest is not None else 0

    def publish(self, step: int, slot: int, controller_state: dict[str, Any]) -> None:
        """Make ``slot`` (every rank has written it) the snapshot a restart resumes from."""
        state_file = os.path.join(self.root, f"slot{slot}", "controller.pt")
        os.makedirs(os.path.dirname(state_file), exist_ok=True)
        torch.save(controller_state, state_file + ".tmp")
        os.replace(state_file + ".tmp", state_file)
        latest = os.path.join(self.root, self.LATEST)
        with open(latest + ".tmp", "w") as f:
            json.dump({"step": step, "slot": slot, "fingerprint": self.fingerprint}, f)
        os.replace(latest + ".tmp", latest)

    def refusal(self, latest: dict[str, Any]) -> str | None:
        """Why the published snapshot cannot be resumed by this run (None: it can)."""
        if latest["fingerprint"] != self.fingerprint:
            return (f"the memory snapshot of step {latest['step']} in {self.root} was written by another config or "
                    "world size; not resuming from it")
        return None

    def load_controller_state(self, slot: int) -> dict[str, Any]:
        return torch.load(os.path.join(self.root, f"slot{slot}", "controller.pt"), weights_only=True)

    def clear(self) -> None:
        """Give the shared memory back (a finished run; the ranks drop their own files first)."""
        shutil.rmtree(self.root, ignore_errors=True)


class SnapshotPublish:
    """A snapshot being written: a thread waits for every trainable rank's write (``written``: each group's
    ``finish_snapshot`` call), then publishes the slot, while the controller goes on with the next step.

    The controller's state is copied now: the next step changes the sampler and the rollout source while the
    ranks write."""

    def __init__(self, snapshots: SnapshotManager, step: int, slot: int, controller_state: dict[str, Any],
                 written: list[Any]) -> None:
        self._error: BaseException | None = None
        state = copy.deepcopy(controller_state)
        self._thread = threading.Thread(target=self._publish, args=(snapshots, step, slot, state, written),
                                        name="torchrlhf-snapshot-publish", daemon=True)
        self._thread.start()

    def _publish(self, snapshots: SnapshotManager, step: int, slot: int, state: dict[str, Any],
                 written: list[Any]) -> None:
        try:
            for future in written:
                future.wait()
            snapshots.publish(step, slot, state)
        except BaseException as e:  # noqa: BLE001 - raised on the controller's thread by `wait`
            self._error = e

    def wait(self) -> None:
        """Block until the slot is published; raises what failed (a rank's write, the publish)."""
        self._thread.join()
        if self._error is not None:
            raise self._error


def run_fingerprint(config: dict[str, Any] | str, world_size: int) -> str:
    """What a memory snapshot must match to be resumed: the resolved config and the world size."""
    text = json.dumps({"config": config, "world_size": world_size}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
