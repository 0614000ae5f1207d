from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Literal

import pytest
from omegaconf import OmegaConf

from torchrlhf.config import ConfigError, apply_overrides, instantiate, load_config, parse_args, validate

YAML = """
seed: 3
optimizer:
  _component_: torch.optim.SGD
  lr: 0.1
algorithm:
  adv_estimator: grpo
  kl_coef: 0.001
  kl_ctrl_type: fixed
trainer:
  total_steps: 10
  loggers: [console, jsonl]
"""


@pytest.fixture
def cfg_path(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(YAML)
    return p


def test_load_and_overrides(cfg_path):
    cfg = load_config(cfg_path, ["algorithm.kl_coef=1e-2", "trainer.loggers=[console]", "+trainer.note=hi", "~optimizer"])
    assert cfg.algorithm.kl_coef == 0.01 and isinstance(cfg.algorithm.kl_coef, float)
    assert list(cfg.trainer.loggers) == ["console"]
    assert cfg.trainer.note == "hi"
    assert "optimizer" not in cfg
    assert cfg.seed == 3


def test_override_replaces_whole_node(cfg_path):
    cfg = load_config(cfg_path, ["algorithm={adv_estimator: gae}"])
    assert OmegaConf.to_container(cfg.algorithm) == {"adv_estimator": "gae"}


def test_unknown_override_key_names_close_match(cfg_path):
    with pytest.raises(ConfigError, match=r"unknown key 'algorithm.kl_coeff'.*algorithm.kl_coef"):
        load_config(cfg_path, ["algorithm.kl_coeff=0.1"])
    with pytest.raises(ConfigError, match=r"unknown key 'trainer.total_step'.*trainer.total_steps"):
        load_config(cfg_path, ["~trainer.total_step"])
    with pytest.raises(ConfigError, match="already exists"):
        load_config(cfg_path, ["+seed=1"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(cfg_path, ["seed"])


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_parse_args():
    assert parse_args(["--config", "a.yaml", "x=1", "~y", "+z=2"]) == ("a.yaml", ["x=1", "~y", "+z=2"])
    assert parse_args(["--config=a.yaml"]) == ("a.yaml", [])
    with pytest.raises(ConfigError, match="missing --config"):
        parse_args(["x=1"])
    with pytest.raises(ConfigError, match="not an override"):
        parse_args(["--config", "a.yaml", "oops"])


# ------------------------------------------------------------------ instantiate
class Outer:
    def __init__(self, inner, scale: float = 1.0, tags=None):
        self.inner, self.scale, self.tags = inner, scale, tags


def make_pair(a, b=2):
    return (a, b)


def test_instantiate_nested_and_args():
    node = OmegaConf.create({
        "_component_": f"{__name__}.Outer",
        "scale": 2.0,
        "inner": {"_component_": f"{__name__}.make_pair", "a": 1},
        "tags": [{"_component_": "collections.Counter"}, "x"],
    })
    obj = instantiate(node, scale=3.0)
    assert isinstance(obj, Outer) and obj.inner == (1, 2) and obj.scale == 3.0
    assert obj.tags == [collections.Counter(), "x"]
    assert instantiate({"_component_": f"{__name__}:make_pair", "b": 5}, 7) == (7, 5)
    assert instantiate(None) is None


def test_instantiate_errors():
    with pytest.raises(ConfigError, match=r"'torch.optim.SGDD'.*has no attribute 'SGDD'.*'SGD'"):
        instantiate({"_component_": "torch.optim.SGDD"})
    with pytest.raises(ConfigError, match="no_such_pkg"):
        instantiate({"_component_": "no_such_pkg.thing"})
    cfg = OmegaConf.create({"outer": {"_component_": f"{__name__}.Outer",
                                      "inner": {"_component_": f"{__name__}.make_pair", "a": 1, "bb": 2}}})
    with pytest.raises(ConfigError, match=r"make_pair.*unexpected argument 'outer.inner.bb'.*did you mean 'b'"):
        instantiate(cfg.outer)
    with pytest.raises(ConfigError, match="missing a required argument: 'a'"):
        instantiate({"_component_": f"{__name__}.make_pair"})
    with pytest.raises(ConfigError, match="has no '_component_'"):
        instantiate({"a": 1})


def test_instantiate_constructor_error_keeps_type_and_adds_note():
    with pytest.raises(ValueError) as info:
        instantiate({"_component_": "torch.optim.SGD", "lr": -1.0}, [__import__("torch").zeros(1, requires_grad=True)])
    assert any("torch.optim.SGD" in n for n in info.value.__notes__)


# ------------------------------------------------------------------ validate
@dataclass
class Algo:
    adv_estimator: Literal["gae", "grpo", "rloo"] = "grpo"
    kl_coef: float = 0.001
    clip: float | None = None
    kl_ctrl_type: Literal["fixed", "adaptive"] = "fixed"


@dataclass
class Trainer:
    total_steps: int
    loggers: list[str] = field(default_factory=lambda: ["console"])
    debug: bool = False


@dataclass
class Root:
    algorithm: Algo = field(default_factory=Algo)
    trainer: Trainer = field(default_factory=lambda: Trainer(total_steps=1))
    seed: int = 0
    optimizer: dict = field(default_factory=dict)


def test_validate_returns_typed_object(cfg_path):
    cfg = load_config(cfg_path, ["algorithm.kl_coef=1"])
    root = validate(cfg, Root)
    assert isinstance(root.algorithm, Algo) and root.algorithm.kl_coef == 1.0 and isinstance(root.algorithm.kl_coef, float)
    assert root.trainer.loggers == ["console", "jsonl"] and root.trainer.total_steps == 10
    assert root.optimizer["_component_"] == "torch.optim.SGD"
    algo = validate(cfg.algorithm, Algo, key="algorithm")
    assert algo.adv_estimator == "grpo"


def test_validate_reports_every_error(cfg_path):
    cfg = load_config(cfg_path, ["algorithm.adv_estimator=grpoo", "trainer.total_steps=1.5",
                                 "trainer.loggers=[1]", "+trainer.debgu=true", "+algorithm.clip=abc"])
    with pytest.raises(ConfigError) as info:
        validate(cfg, Root)
    msg = str(info.value)
    assert "algorithm.adv_estimator: expected one of ['gae', 'grpo', 'rloo'], got 'grpoo'" in msg
    assert "trainer.total_steps: expected int, got 1.5" in msg
    assert "trainer.loggers[0]: expected str, got 1" in msg
    assert "trainer.debgu: unknown key (did you mean 'debug'?)" in msg
    assert "algorithm.clip: expected None or float, got 'abc'" in msg


def test_validate_bool_is_not_int_and_required_keys():
    with pytest.raises(ConfigError, match=r"trainer.total_steps: expected int, got True"):
        validate({"trainer": {"total_steps": True}}, Root)
    with pytest.raises(ConfigError, match=r"total_steps: missing required key"):
        validate({}, Trainer)
    with pytest.raises(ConfigError, match=r"debug: expected bool, got 'yes'"):
        validate({"total_steps": 1, "debug": "yes"}, Trainer)
    assert validate({"clip": None}, Algo).clip is None


def test_apply_overrides_on_a_notebook_config():
    cfg = OmegaConf.create({"rollout": {"n": 4, "stop": ["\n"]}})
    apply_overrides(cfg, ["rollout.n=8", "rollout.stop.0=END", "+rollout.seed=1"])
    assert OmegaConf.to_container(cfg) == {"rollout": {"n": 8, "stop": ["END"], "seed": 1}}
    with pytest.raises(ConfigError, match="is a list of 1"):
        apply_overrides(cfg, ["rollout.stop.3=x"])
    with pytest.raises(ConfigError, match="is a value"):
        apply_overrides(cfg, ["rollout.n.x=1"])


def test_add_missing_lets_plain_override_add_a_key_for_schema_checked_configs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("actor:\n  lr: 0.1\nmodel_path: ???\n")
    with pytest.raises(ConfigError, match="unknown key 'actor.ppo_epochs'"):
        load_config(path, ["actor.ppo_epochs=2"])
    cfg = load_config(path, ["actor.ppo_epochs=2", "model_path=/m"], add_missing=True)
    assert cfg.actor.ppo_epochs == 2 and cfg.actor.lr == 0.1 and cfg.model_path == "/m"
