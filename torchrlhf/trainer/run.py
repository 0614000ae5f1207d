"""The recipe's run as a function: what ``recipes/ppo.py`` does, callable from a notebook or a script.

    from torchrlhf.trainer.run import train
    metrics = train("recipes/configs/grpo_arithmetic_cpu.yaml", ["trainer.total_steps=2"])

At world size 1 the whole job runs in the calling process (the controller and every role), so it works
in a notebook and can be called again. Under torchrun, call it on every rank with the same arguments:
rank 0 runs the controller and returns the final metrics; the other ranks serve it and exit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from torchrlhf.config import ConfigError, apply_overrides, load_config
from torchrlhf.runtime import launch
from torchrlhf.trainer.build import build_trainer
from torchrlhf.trainer.schema import RecipeConfig, load_recipe_config


def load(config: str | os.PathLike | Mapping, overrides: Sequence[str] = (), world_size: int = 1
         ) -> tuple[RecipeConfig, dict]:
    """Read ``config`` (a YAML path, or a mapping such as a loaded ``DictConfig``), apply ``overrides``
    (``key=value``, as on the command line) and validate it for ``world_size`` ranks.

    Returns (the validated config, the resolved plain dict the checkpoints record). Raises `ConfigError`
    listing every problem, or FileNotFoundError, before anything loads.
    """
    if isinstance(config, (str, os.PathLike)):
        raw = load_config(Path(config), overrides, add_missing=True)  # the schema checks every key
    elif not isinstance(config, Mapping):
        raise TypeError(f"config must be a YAML path or a mapping (a dict, a DictConfig), got {type(config).__name__}")
    else:  # a copy: the caller's config stays as it was
        raw = apply_overrides(OmegaConf.create(OmegaConf.to_container(config) if isinstance(config, DictConfig)
                                               else dict(config)), overrides, add_missing=True)
    missing = [key for key in sorted(OmegaConf.missing_keys(raw)) if _is_literal_missing(raw, key)]
    if missing:  # a config that asks for a value (`???`, e.g. the 8-GPU configs' model_path)
        raise ConfigError("; ".join(f"{key}: required (??? in the config); set it, e.g. {key}=..." for key in missing))
    return load_recipe_config(raw, world_size), OmegaConf.to_container(raw, resolve=True)


def _is_literal_missing(cfg: DictConfig, key: str) -> bool:
    """``key`` is ``???`` itself, not an interpolation of a missing value (reported at its source)."""
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return OmegaConf.is_missing(node, last) and not OmegaConf.is_interpolation(node, last)


def run(cfg: RecipeConfig, raw: dict, world_size: int) -> dict[str, float]:
    """The controller's part (rank 0, inside `launch`): build the worker groups and the trainer, fit, close."""
    trainer = build_trainer(cfg, world_size, raw)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def train(config: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> dict[str, float]:
    """Validate ``config`` with ``overrides`` and run it; returns the last step's metrics (on rank 0).

    The world size is torchrun's ``WORLD_SIZE`` (1 without torchrun).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg, raw = load(config, overrides, world_size)
    return launch(run, cfg, raw, world_size)
