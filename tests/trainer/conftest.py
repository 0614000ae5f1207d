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

sys.path.insert(0, str(ROOT / "tests" / "workers"))
from dist_helpers import free_port  # noqa: E402
import warm_processes  # noqa: E402

warm_processes.start_server()  # the warm one, before a test starts another

# A small GRPO run on the arithmetic prompts; tests override what they exercise.
BASE: dict[str, Any] = {
    "data": {
        "train_files": [str(ROOT / "recipes/data/arithmetic_train.jsonl")],
        "val_files": [str(ROOT / "recipes/data/arithmetic_test.jsonl")],
        "max_prompt_length": 64, "train_batch_size": 4, "val_batch_size": 16, "val_max_samples": 16,
    },
    "rollout": {"n": 4, "max_tokens": 8, "engine": {"max_batch_size": 16, "max_seq_len": 80}},
    "algorithm": {"adv_estimator": "grpo"},
    "actor": {"optim": {"lr": 3e-3}, "batching": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 16}},
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
    """BASE with ``sections`` merged in (sub-sections too; a section given as None is set to null), saved as YAML."""
    cfg = copy.deepcopy(BASE)
    cfg["model_path"] = model_dir
    cfg["actor"]["model_path"] = "${model_path}"
    for name, value in sections.items():
        if value is None or not isinstance(value, dict):
            cfg[name] = value
        else:
            cfg[name] = _merged(cfg.get(name, {}), value)
    OmegaConf.save(OmegaConf.create(cfg), path)
    return path


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _rank_env(**extra: str) -> dict[str, str]:
    # tests/trainer on the path of every rank: custom_components.py is imported by ``_component_`` tests.
    path = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path, **extra}


def run_recipe(config: Path, *overrides: str, nproc: int = 1, timeout: float = 600, max_restarts: int = 0,
               cwd: Path = ROOT, torchrun: bool = False) -> subprocess.CompletedProcess:
    """Run the recipe's command line as a user would, from ``cwd`` (the project folder).

    ``torchrun`` (or ``max_restarts``, torchrun's ``--max-restarts``): ``python recipes/ppo.py`` (one process)
    or torchrun, exactly. Otherwise the ranks are forked from a process that imported the recipe once
    (`warm_processes.run_forked`, what most tests use: it saves each rank ~9-15 s of imports) and rendezvous as
    ``srun`` starts them; their outputs are joined in rank order, and a failed rank ends the others as torchrun
    does.
    """
    if not torchrun and not max_restarts:
        ranks = warm_processes.one_node(nproc, _rank_env(), free_port(span=2))
        return warm_processes.run_forked(["--config", str(config), *overrides], ranks, cwd, timeout,
                                         end_all_on_failure=True)
    if nproc == 1 and not max_restarts:
        cmd = [sys.executable, str(RECIPE)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               f"--max-restarts={max_restarts}", str(RECIPE)]
    return subprocess.run([*cmd, "--config", str(config), *overrides], capture_output=True, text=True,
                          timeout=timeout, env=_rank_env(), cwd=cwd)


def run_recipe_per_rank(config: Path, *overrides: str, nproc: int, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Each rank its own process with torchrun's variables set by hand, as ``srun`` (or one torchrun per node)
    starts them, each rank a node of its own (``GROUP_RANK``): no local agent stops the other ranks when one
    dies. One answer per rank."""
    port = free_port(span=2)  # the process group's store and, without a torchrun agent, RPC's
    ranks = [_rank_env(RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                       GROUP_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
             for rank in range(nproc)]
    return warm_processes.run_forked(["--config", str(config), *overrides], ranks, ROOT, timeout,
                                     end_all_on_failure=False, joined=False)


def metrics_of(output_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"recipe failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
