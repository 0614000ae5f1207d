"""Automatic recovery from a lost rank: torchrun restarts the job and ``trainer.checkpoint.resume=auto`` goes on.

A rank SIGKILLs itself once (`custom_components.KillOnceActor`, guarded by a marker file) at the update of
step 4, after the checkpoint of step 2 and after step 3 was logged. Under ``torchrun --max-restarts=1`` the
job restarts, resumes from ``global_step_2`` and trains to ``total_steps``. The synchronous schedule is
deterministic, so every step's metrics equal an uninterrupted run's, and metrics.jsonl holds each step once.
With a memory snapshot every step, the restart resumes from step 3's snapshot instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import assert_ok, metrics_of, run_recipe, run_recipe_per_rank, write_config

STEPS, SAVE_FREQ, KILL_AT_UPDATE = 4, 2, 4
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"]


def _config(tmp: Path, model_dir: str, name: str, kill_rank: int, snapshot_dir: Path | None = None,
            snapshot_peer: bool = False) -> Path:
    out = tmp / name
    actor = {"_component_": "custom_components.KillOnceActor", "kill_rank": kill_rank,
             "kill_at_update": KILL_AT_UPDATE, "marker": str(tmp / f"{name}.killed"), "optim": {"lr": 3e-2},
             "batching": {"ppo_micro_batch_size_per_device": 4}}
    checkpoint = {"save_freq": SAVE_FREQ}
    if snapshot_dir is not None:
        checkpoint.update(snapshot_freq=1, snapshot_dir=str(snapshot_dir), snapshot_peer=snapshot_peer)
    trainer = {"total_steps": STEPS, "checkpoint": checkpoint, "test_freq": 0, "output_dir": str(out),
               "loggers": ["console", "jsonl"]}
    return write_config(tmp / f"{name}.yaml", model_dir, actor=actor, trainer=trainer)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    assert_ok(run_recipe(_config(tmp, tiny_model_dir, "straight", kill_rank=-1), nproc=2, max_restarts=1))
    return metrics_of(tmp / "straight")


@pytest.mark.parametrize("kill_rank", [1, 0], ids=["worker_rank", "controller_rank"])
def test_a_killed_rank_restarts_and_resumes_to_the_same_metrics(tiny_model_dir, tmp_path, uninterrupted, kill_rank):
    config = _config(tmp_path, tiny_model_dir, "killed", kill_rank)
    proc = run_recipe(config, nproc=2, max_restarts=1)
    assert_ok(proc)
    marker = tmp_path / "killed.killed"
    assert marker.read_text() == f"killed rank {kill_rank} at update {KILL_AT_UPDATE}\n"
    assert f"resumed from {tmp_path / 'killed' / 'global_step_2'} at step 2 of {STEPS}" in proc.stdout, proc.stdout
    got = metrics_of(tmp_path / "killed")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))  # step 3 ran twice but is logged once
    assert [m["step"] for m in uninterrupted] == list(range(1, STEPS + 1))
    for want_row, got_row in zip(uninterrupted, got):
        for key in COMPARED:
            assert got_row[key] == pytest.approx(want_row[key], rel=1e-4, abs=1e-6), (got_row["step"], key)


def test_a_killed_rank_resumes_from_the_memory_snapshot(tiny_model_dir, tmp_path, uninterrupted):
    """With a memory snapshot every step the restart resumes from step 3's (in memory), not from the disk
    checkpoint of step 2: no step that had ended runs again. The finished run gives the memory back."""
    shm = tmp_path / "shm"
    proc = run_recipe(_config(tmp_path, tiny_model_dir, "killed", kill_rank=1, snapshot_dir=shm), nproc=2,
                      max_restarts=1)
    assert_ok(proc)
    assert (tmp_path / "killed.killed").read_text() == f"killed rank 1 at update {KILL_AT_UPDATE}\n"
    want = f"resumed from the memory snapshot of step 3 ({shm}) at step 3 of {STEPS}"
    assert want in proc.stdout, proc.stdout
    assert f"a memory snapshot every 1 step(s) in {shm}" in proc.stdout
    got = metrics_of(tmp_path / "killed")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for want_row, got_row in zip(uninterrupted, got):
        for key in COMPARED:
            assert got_row[key] == pytest.approx(want_row[key], rel=1e-4, abs=1e-6), (got_row["step"], key)
    assert not shm.exists()


def test_a_lost_node_resumes_from_the_copy_on_another_node(tiny_model_dir, tmp_path, uninterrupted):
    """Two ranks on two nodes (one process each, as srun starts them), each snapshot also kept on the other
    node. Rank 1 is SIGKILLed in step 4's update and its node's memory is lost with it (deleted here; no
    restarts: the job ends). The same command resumes from step 3's snapshot, rank 1's part copied back from
    node 0, and every step equals an uninterrupted run."""
    shm = tmp_path / "shm"
    config = _config(tmp_path, tiny_model_dir, "node", kill_rank=1, snapshot_dir=shm, snapshot_peer=True)
    killed = run_recipe_per_rank(config, nproc=2)
    assert killed[1].returncode != 0 and (tmp_path / "node.killed").exists(), killed[0].stdout + killed[0].stderr
    assert "each memory snapshot of actor is also kept on another node (rank -> keeper: {0: 1, 1: 0})" in \
        killed[0].stdout
    shutil.rmtree(shm / "node1")
    again = run_recipe_per_rank(config, nproc=2)
    assert all(p.returncode == 0 for p in again), again[0].stdout[-3000:] + again[0].stderr[-3000:]
    assert (f"resumed from the memory snapshot of step 3 ({shm}) (parts lost with their node, copied back from "
            f"another node: actor rank 1 from rank 0) at step 3 of {STEPS}") in again[0].stdout, again[0].stdout
    got = metrics_of(tmp_path / "node")
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for want_row, got_row in zip(uninterrupted, got):
        for key in COMPARED:
            assert got_row[key] == pytest.approx(want_row[key], rel=1e-4, abs=1e-6), (got_row["step"], key)
    assert not (shm / "node0").exists()


def test_a_snapshot_missing_on_a_rank_falls_back_to_the_disk(tiny_model_dir, tmp_path):
    """One process, killed for good in step 3's update (no restarts): its snapshot of step 2 stays in memory.
    A rank's part of it lost (as on a replaced node), the same command resumes from the disk and says why."""
    shm, out = tmp_path / "shm", tmp_path / "once"
    actor = {"_component_": "custom_components.KillOnceActor", "kill_rank": 0, "kill_at_update": 3,
             "marker": str(tmp_path / "once.killed"), "batching": {"ppo_micro_batch_size_per_device": 4}}
    trainer = {"total_steps": 3, "checkpoint": {"save_freq": 1, "snapshot_freq": 1, "snapshot_dir": str(shm)},
               "test_freq": 0, "output_dir": str(out), "loggers": ["console", "jsonl"]}
    config = write_config(tmp_path / "once.yaml", tiny_model_dir, actor=actor, trainer=trainer)
    killed = run_recipe(config)
    assert killed.returncode != 0 and (tmp_path / "once.killed").exists(), killed.stdout + killed.stderr
    latest = json.loads((shm / "LATEST").read_text())
    assert latest["step"] == 2
    (shm / "node0" / f"slot{latest['slot']}" / "actor" / "rank0.pt").unlink()
    again = run_recipe(config)
    assert_ok(again)
    assert (f"torchrlhf: the memory snapshot of step 2 in {shm} is incomplete on the ranks {{'actor': [0]}} (a node "
            "replaced?), with no copy on another node; not resuming from it; resuming from "
            f"{out / 'global_step_2'}") in again.stdout, again.stdout
    assert f"resumed from {out / 'global_step_2'} at step 2 of 3" in again.stdout
    assert [m["step"] for m in metrics_of(out)] == [1, 2, 3] and not shm.exists()


def test_a_second_run_of_a_finished_job_says_it_has_nothing_to_train(tiny_model_dir, tmp_path):
    """The newcomer's snag: the same command again resumes the finished run (resume=auto) and trains nothing."""
    out = tmp_path / "out"
    trainer = {"total_steps": 1, "checkpoint": {"save_freq": 1}, "test_freq": 0, "output_dir": str(out),
               "loggers": ["console", "jsonl"]}
    config = write_config(tmp_path / "c.yaml", tiny_model_dir, trainer=trainer)
    assert_ok(run_recipe(config))
    again = run_recipe(config)
    assert_ok(again)
    want = (f"torchrlhf: resumed from {out / 'global_step_1'}: total_steps=1 already reached; nothing to train; "
            "trainer.checkpoint.resume=disable or a new trainer.output_dir starts afresh")
    assert want in again.stdout, again.stdout
    assert [m["step"] for m in metrics_of(out)] == [1]
    fresh = run_recipe(config, "trainer.checkpoint.resume=disable")
    assert_ok(fresh)
    assert "resumed from" not in fresh.stdout and "step 1:" in fresh.stdout, fresh.stdout
