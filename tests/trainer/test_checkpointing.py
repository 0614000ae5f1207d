"""The controller's checkpoint directories under faults: half-written, corrupted, a full disk mid-save."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from torchrlhf.trainer.checkpointing import COMPLETE, CheckpointManager


def _save_roles(path: str) -> None:
    os.makedirs(f"{path}/actor")
    torch.save({"w": torch.ones(2)}, f"{path}/actor/state.pt")


def test_resume_auto_skips_a_half_written_latest_checkpoint(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    manager.save(2, _save_roles, {"global_step": 2})
    manager.save(4, _save_roles, {"global_step": 4})
    os.remove(tmp_path / "global_step_4" / COMPLETE)  # killed before the marker was written
    assert manager.resolve("auto") == str(tmp_path / "global_step_2")
    assert manager.load_controller_state(manager.resolve("auto"))["global_step"] == 2
    with pytest.raises(FileNotFoundError, match="is not a complete checkpoint"):
        manager.resolve(str(tmp_path / "global_step_4"))


def test_a_corrupted_controller_state_is_named(tmp_path):
    manager = CheckpointManager(str(tmp_path))
    path = manager.save(2, _save_roles, {"global_step": 2})
    (tmp_path / "global_step_2" / "controller.pt").write_bytes(b"\x00garbage")
    with pytest.raises(RuntimeError, match=r"checkpoint file .*global_step_2/controller.pt is unreadable"):
        manager.load_controller_state(path)


def test_a_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(str(tmp_path), keep_last=1)
    manager.save(2, _save_roles, {"global_step": 2})

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(RuntimeError) as e:
        manager.save(4, _save_roles, {"global_step": 4})
    message = str(e.value)
    assert "saving checkpoint" in message and "global_step_4 failed (OSError" in message, message
    assert "No space left on device" in message and "global_step_2, is intact" in message, message
    monkeypatch.undo()
    assert manager.resolve("auto") == str(tmp_path / "global_step_2")  # not pruned, still complete
    assert manager.load_controller_state(manager.resolve("auto"))["global_step"] == 2
