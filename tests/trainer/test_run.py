"""`torchrlhf.trainer.run`: the recipe's run called from Python, as in a notebook."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
from conftest import BASE, ROOT, metrics_of, write_config

from torchrlhf.config import ConfigError
from torchrlhf.trainer.run import load

SCRIPT = """
import json, sys
from omegaconf import OmegaConf
from torchrlhf.trainer.run import train

path, second_dir = sys.argv[1:3]
first = train(path, ["trainer.total_steps=1"])
cfg = OmegaConf.load(path)
cfg.trainer.output_dir = second_dir
second = train(cfg, ["actor.optim.lr=1e-3"])  # a second run in the same process, from a loaded config
print("RESULT", json.dumps({"first": first["critic/score/mean"], "second": second["critic/score/mean"],
                            "lr_after": cfg.actor.optim.lr}))
"""


def test_train_twice_in_one_process_from_a_path_and_from_a_config(tiny_model_dir, tmp_path):
    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    config = write_config(tmp_path / "c.yaml", tiny_model_dir,
                          trainer={"total_steps": 2, "output_dir": str(first_dir), "loggers": ["jsonl"]})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(config), str(second_dir)], capture_output=True,
                       text=True, timeout=600, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    result = next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))
    got = json.loads(result.removeprefix("RESULT "))
    assert len(metrics_of(first_dir)) == 1 and len(metrics_of(second_dir)) == 2  # each run's own steps
    assert got["first"] == metrics_of(first_dir)[-1]["critic/score/mean"]  # the last step's metrics returned
    assert got["second"] == metrics_of(second_dir)[-1]["critic/score/mean"]
    assert got["lr_after"] == BASE["actor"]["optim"]["lr"]  # the override did not change the caller's config


def test_load_lists_config_errors_before_anything_loads(tmp_path):
    raw = copy.deepcopy(BASE)
    raw["model_path"] = str(tmp_path)  # it exists; no model is read
    raw["actor"]["model_path"] = "${model_path}"
    cfg, resolved = load(raw, ["actor.optim.lr=0.5"])
    assert resolved["actor"]["optim"]["lr"] == 0.5 and resolved["actor"]["model_path"] == raw["model_path"]  # resolved
    assert raw["actor"]["optim"]["lr"] == BASE["actor"]["optim"]["lr"]  # the caller's mapping is untouched
    with pytest.raises(ConfigError, match=r"actor\.optim\.lrr: unknown key \(did you mean 'lr'\?\)"):
        load(raw, ["actor.optim.lrr=0.1"])
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load(tmp_path / "missing.yaml")
    with pytest.raises(TypeError, match="a YAML path or a mapping .* got RecipeConfig"):
        load(cfg)  # the validated object is not a config to load


def test_load_names_a_required_value_the_config_leaves_unset():
    """The 8-GPU configs say ``model_path: ???``: without it, one config error instead of an OmegaConf trace."""
    raw = copy.deepcopy(BASE)
    raw["model_path"] = "???"
    raw["actor"]["model_path"] = "${model_path}"  # reported once, at its source
    with pytest.raises(ConfigError) as e:
        load(raw)
    assert str(e.value) == "model_path: required (??? in the config); set it, e.g. model_path=..."
