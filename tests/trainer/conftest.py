"""Shared fixtures for recipe tests: a tiny random Llama with the SmolLM2 tokenizer, and a recipe runner."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "ppo.py"
REWARD_FNS = Path(__file__).with_name("reward_fns.py")

# A small GRPO run on the arithmetic prompts; tests override what they exercise.
BASE: dict[str, Any] = {
    "data": {
        "train_files": [str(ROOT / "recipes/data/arithmetic_train.jsonl")],
        "val_files": [str(ROOT / "recipes/data/arithmetic_test.jsonl")],
        "max_prompt_length": 64, "train_batch_size": 4, "val_batch_size": 16, "val_max_samples": 16,
    },
    "rollout": {"n": 4, "max_tokens": 8, "engine": {"max_batch_size": 16, "max_seq_len": 80}},
    "algorithm": {"adv_estimator": "grpo"},
    "actor": {"lr": 3e-3, "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 16},
    "reward": {"reward_fn": f"{REWARD_FNS}:e_fraction", "isolate": False},
    "trainer": {"total_steps": 2, "loggers": ["jsonl"]},
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from torchrlhf.models import save_tiny_model

    # initializer_range=1.0 gives peaked next-token distributions (entropy ~1 nat instead of ~8), so a
    # reward that prefers some tokens has candidates to choose between and a few steps show learning.
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny_lm"), tokenizer_from="smollm2", initializer_range=1.0))


def write_config(path: Path, model_dir: str, **sections: dict[str, Any]) -> Path:
    """BASE with ``sections`` merged in (a section given as None is set to null), saved as YAML."""
    cfg = copy.deepcopy(BASE)
    cfg["model_path"] = model_dir
    cfg["actor"]["model_path"] = "${model_path}"
    for name, value in sections.items():
        if value is None or not isinstance(value, dict):
            cfg[name] = value
        else:
            cfg[name] = {**cfg.get(name, {}), **value}
    OmegaConf.save(OmegaConf.create(cfg), path)
    return path


def run_recipe(config: Path, *overrides: str, nproc: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the recipe as a user would: ``python recipes/ppo.py`` (one process) or under torchrun."""
    if nproc == 1:
        cmd = [sys.executable, str(RECIPE)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(RECIPE)]
    # tests/trainer on the path of every rank: custom_components.py is imported by ``_component_`` tests.
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    return subprocess.run([*cmd, "--config", str(config), *overrides], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def metrics_of(output_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"recipe failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
