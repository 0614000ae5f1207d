"""A config error that every rank finds reaches the terminal once, under torchrun, in every run.

torchrun kills the other ranks (SIGTERM) once one exits: when rank 1 exited before rank 0 had printed, the log held
only torchrun's traceback (1 of 6 runs). Each case runs the recipe as a user does, 2 ranks, and reads torchrun's
whole output.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT, run_recipe

SHIPPED = ROOT / "recipes" / "configs" / "grpo_arithmetic_cpu.yaml"
INCONSISTENT = ("rollout.max_tokens=48", "placement.actor=[0]", "placement.rollout=[1]")


def _run_times(times: int, *overrides: str) -> list:
    with ThreadPoolExecutor(2) as pool:  # two at a time: ranks that compete for the cores, as on a busy host
        return list(pool.map(lambda _: run_recipe(SHIPPED, *overrides, nproc=2, timeout=180, torchrun=True), range(times)))


def _assert_reported_once(proc, message: str) -> None:
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert log.count("torchrlhf: config error:") == 1 and message in log, log[-3000:]
    # torchrun's summary names rank 0's exit code 2 (a config error) as the root cause, not a SIGTERM
    root_cause = log.split("Root Cause (first observed failure):", 1)[-1]
    assert "rank      : 0 " in root_cause and "exitcode  : 2 " in root_cause, log[-3000:]


def test_an_inconsistent_config_is_reported_in_every_run(tiny_model_dir):
    message = ("torchrlhf: config error: inconsistent config:\n"
               "  - data.max_prompt_length (64) + rollout.max_tokens (48) exceeds rollout.engine.max_seq_len (96)\n")
    # 6 runs: on the code before the fix the root-cause check failed in every run and the message went missing in
    # 1 run of 6 (the race), which 6 runs catch with p = 1 - (5/6)^6 = 0.67 (10 runs took 135 s of the suite)
    for proc in _run_times(6, f"model_path={tiny_model_dir}", *INCONSISTENT):
        _assert_reported_once(proc, message)


@pytest.mark.parametrize("override,message", [
    ("data.train_files=[/nonexistent/train.jsonl]",
     "  - data.train_files: no such file(s) ['/nonexistent/train.jsonl']"),
    ("model_path=/nonexistent/model", "  - actor.model_path: model path does not exist: /nonexistent/model\n"),
])
def test_a_missing_data_file_or_model_is_reported_in_every_run(tiny_model_dir, override, message):
    overrides = [override] if override.startswith("model_path") else [f"model_path={tiny_model_dir}", override]
    for proc in _run_times(2, *overrides):
        _assert_reported_once(proc, message)
