"""`recipes/ppo.py --plan` as a user runs it: the table, a written config that validates and trains one step on 2
ranks, the user's file untouched; and the dry run's simulated time."""

from __future__ import annotations

import subprocess
import sys

from conftest import RECIPE, ROOT, run_recipe, write_config

from torchrlhf.trainer.run import load

MICRO_1 = {"batching": {"ppo_micro_batch_size_per_device": 1}}  # valid on 1 or 2 ranks


def _cli(*args: str, home=None) -> subprocess.CompletedProcess:
    env = None
    if home is not None:
        import os

        env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(RECIPE), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=600, env=env)


def test_plan_writes_a_config_that_validates_and_trains_a_step(tiny_model_dir, tmp_path):
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir, actor=MICRO_1)
    before = cfg_path.read_text()
    out = tmp_path / "planned.yaml"
    done = _cli("--config", str(cfg_path), "--plan", "--world-size", "2", "--hardware", "cpu_xeon_2core",
                "--plan-out", str(out), "trainer.total_steps=1")
    assert done.returncode == 0, done.stderr
    assert "torchrlhf plan: world size 2" in done.stdout and f"best plan written to {out}" in done.stdout
    assert "   1 " in done.stdout and "bottleneck" in done.stdout
    assert cfg_path.read_text() == before  # the user's file is never changed
    cfg, _ = load(out, [], 2)  # validates as a run would
    assert cfg.trainer.total_steps == 1  # the user's command-line overrides are kept
    run = run_recipe(out, nproc=2, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]


def test_dry_run_with_a_hardware_profile_prints_the_simulated_step(tiny_model_dir, tmp_path):
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir, actor=MICRO_1)
    done = _cli("--config", str(cfg_path), "--dry-run", "--world-size", "2", "--hardware", "h100")
    assert done.returncode == 0, done.stderr
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("simulated time per step on H100")]
    assert line and "generate" in line[0] and "update_actor" in line[0]


def test_plan_without_a_profile_says_how_to_get_one(tiny_model_dir, tmp_path):
    cfg_path = write_config(tmp_path / "c.yaml", tiny_model_dir, actor=MICRO_1)
    done = _cli("--config", str(cfg_path), "--plan", "--world-size", "2", home=tmp_path)
    assert done.returncode == 2 and "--calibrate" in done.stderr and "--hardware h100" in done.stderr
    bad = _cli("--config", str(cfg_path), "--plan", "--world-size", "4", "--nodes", "3", "--hardware", "h100")
    assert bad.returncode == 2 and "--nodes 3 must divide --world-size 4" in bad.stderr
