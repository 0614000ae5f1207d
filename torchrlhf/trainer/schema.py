"""The whole recipe config as one schema, plus the checks that span sections.

Worker sections (``actor``, ``critic``, ``reward_model``, ``cost_model``) and ``reward`` are generated
from the constructors they configure, so a config key is always a constructor argument; a section's
``_component_`` names the class (a subclass of the library's, for users who override a method). Keys
the recipe derives from other sections (``rollout_n``, ``total_steps``, ...) are excluded and read as
unknown keys if set.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from torchrlhf import algorithms
from torchrlhf.algorithms.rollout_is import check_rollout_is
from torchrlhf.config import ConfigError, get_component, schema_from_signature, validate
from torchrlhf.rewards import RewardManager
from torchrlhf.trainer.config import (
    AlgorithmConfig,
    AsyncConfig,
    DataConfig,
    PlacementConfig,
    RefConfig,
    RolloutConfig,
    TrainerConfig,
)
from torchrlhf.generation import NativeEngine
from torchrlhf.workers import ActorWorker, CriticWorker, RewardModelWorker
from torchrlhf.workers.rollout import ENGINE_ARGS_SET_BY_ROLE

GROUP_ESTIMATORS = {"grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "grpo_passk"}

# Sections that configure a class: role -> (base class, constructor arguments the recipe sets itself).
# A section may name a subclass with ``_component_: my_pkg.MyActor``; its own constructor then
# defines the valid keys, so extra arguments of a user's subclass validate like the built-in ones.
COMPONENT_SECTIONS: dict[str, tuple[type, tuple[str, ...]]] = {
    "actor": (ActorWorker, ("rollout_n", "total_steps", "freeze")),
    "critic": (CriticWorker, ("rollout_n", "total_steps")),
    "reward_model": (RewardModelWorker, ("output_key",)),
    "cost_model": (RewardModelWorker, ("output_key",)),
    "reward": (RewardManager, ("tokenizer",)),
}


ENGINE_KEY = "rollout.engine"  # a nested component section: the rollout engine class and its arguments
ENGINE_METHODS = ("generate", "update_weights", "param_shard_dims", "release", "resume")

# Keys that moved; an old config gets told where they went instead of "unknown key".
MOVED_KEYS = {
    "actor.generation_tp_size": "rollout.tp_size",
    "actor.generation_max_batch_size": "rollout.engine.max_batch_size",
    "actor.generation_max_seq_len": "rollout.engine.max_seq_len",
    "actor.generation_cuda_graphs": "rollout.engine.cuda_graphs",
}


def component_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def section_schema(cls: type, exclude: tuple[str, ...]) -> type:
    """The schema of a section configuring ``cls``: its constructor's arguments plus ``_component_``."""
    base = schema_from_signature(cls, name=f"{cls.__name__}Section", exclude=exclude)
    component = ("_component_", str, dataclasses.field(default=component_path(cls)))
    return dataclasses.make_dataclass(base.__name__, [component], bases=(base,))


def recipe_schema(components: Mapping[str, type] | None = None) -> type:
    """`RecipeConfig` with each component section typed by its chosen class (default: the library's)."""
    return _recipe_schema(tuple(sorted((components or {}).items())))


@functools.cache
def _recipe_schema(chosen: tuple[tuple[str, type], ...]) -> type:
    components = dict(chosen)
    sections = {role: section_schema(components.get(role, base), exclude)
                for role, (base, exclude) in COMPONENT_SECTIONS.items()}
    engine = section_schema(components.get(ENGINE_KEY, NativeEngine), ENGINE_ARGS_SET_BY_ROLE)
    rollout = dataclasses.make_dataclass(
        "RolloutSection", [("engine", engine, dataclasses.field(default_factory=engine))], bases=(RolloutConfig,))
    return dataclasses.make_dataclass("RecipeConfig", [
        ("data", DataConfig),
        ("actor", sections["actor"]),
        ("rollout", rollout),
        ("algorithm", AlgorithmConfig),
        ("trainer", TrainerConfig),
        ("async_training", AsyncConfig),
        ("reward", sections["reward"]),
        ("ref", RefConfig),
        ("placement", PlacementConfig),
        ("critic", sections["critic"] | None, dataclasses.field(default=None)),
        ("reward_model", sections["reward_model"] | None, dataclasses.field(default=None)),
        ("cost_model", sections["cost_model"] | None, dataclasses.field(default=None)),
        # A shared default the sections interpolate (``${model_path}``).
        ("model_path", str | None, dataclasses.field(default=None)),
        ("tokenizer_path", str | None, dataclasses.field(default=None)),  # default: the actor's model_path
    ])


RecipeConfig = recipe_schema()  # the schema with the library's classes, for type hints and notebooks


def chosen_components(cfg: Mapping[str, Any]) -> dict[str, type]:
    """The class each section names with ``_component_``; it must subclass the library's class."""
    chosen, errors = {}, []
    for role, (base, _) in COMPONENT_SECTIONS.items():
        section = cfg.get(role)
        if not isinstance(section, Mapping) or section.get("_component_") is None:
            continue
        key = f"{role}._component_"
        try:
            cls = get_component(section["_component_"])
        except ConfigError as e:
            errors.append(f"{key}: {e}")
            continue
        if not (isinstance(cls, type) and issubclass(cls, base)):
            errors.append(f"{key}: {section['_component_']!r} must be a subclass of {component_path(base)}")
            continue
        chosen[role] = cls
    engine = (cfg.get("rollout") or {}).get("engine") if isinstance(cfg.get("rollout"), Mapping) else None
    if isinstance(engine, Mapping) and engine.get("_component_") is not None:
        try:
            cls = get_component(engine["_component_"])
            missing = [m for m in ENGINE_METHODS if not callable(getattr(cls, m, None))]
            if not isinstance(cls, type) or missing:
                raise ConfigError(f"{engine['_component_']!r} is not a rollout engine class (missing {missing}; "
                                  "see torchrlhf.generation.RolloutEngine)")
            chosen[ENGINE_KEY] = cls
        except ConfigError as e:
            errors.append(f"{ENGINE_KEY}._component_: {e}")
    if errors:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {e}" for e in errors))
    return chosen


def needs_reference(cfg: RecipeConfig) -> bool:
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def role_ranks(cfg: RecipeConfig, world_size: int) -> dict[str, list[int]]:
    """Ranks of every configured role (the reference always sits with the actor)."""
    p = cfg.placement
    actor = list(p.actor) if p.actor is not None else list(range(world_size))
    ranks = {"actor": actor, "rollout": list(p.rollout) if p.rollout is not None else actor}
    if needs_reference(cfg):
        ranks["ref"] = actor
    for role in ("critic", "reward_model", "cost_model"):
        if getattr(cfg, role) is not None:
            chosen = getattr(p, role)
            ranks[role] = list(chosen) if chosen is not None else actor
    return ranks


def check(cfg: RecipeConfig, world_size: int) -> None:
    """Cross-section consistency; raises `ConfigError` listing every problem with its keys."""
    errors: list[str] = []
    algo, rollout, actor, data = cfg.algorithm, cfg.rollout, cfg.actor, cfg.data
    if algo.adv_estimator not in algorithms.ADV_ESTIMATORS:
        errors.append(f"algorithm.adv_estimator: unknown {algo.adv_estimator!r}; valid: {sorted(algorithms.ADV_ESTIMATORS)}")
    if actor.policy_loss not in algorithms.POLICY_LOSSES:
        errors.append(f"actor.policy_loss: unknown {actor.policy_loss!r}; valid: {sorted(algorithms.POLICY_LOSSES)}")
    if algo.adv_estimator == "gae" and cfg.critic is None:
        errors.append("algorithm.adv_estimator=gae (PPO) needs a critic section")
    if algo.adv_estimator != "gae" and cfg.critic is not None:
        errors.append(f"a critic is configured but algorithm.adv_estimator={algo.adv_estimator} does not use values; "
                      "remove the critic section (critic=null) or use gae")
    if algo.adv_estimator in GROUP_ESTIMATORS and rollout.n < 2:
        errors.append(f"algorithm.adv_estimator={algo.adv_estimator} compares responses of one prompt: "
                      f"rollout.n must be >= 2, got {rollout.n}")
    if algo.adv_estimator == "remax" and rollout.n != 1:
        errors.append("algorithm.adv_estimator=remax samples one response plus a greedy baseline: set rollout.n=1")
    if algo.filter_groups and algo.adv_estimator not in GROUP_ESTIMATORS:
        errors.append("algorithm.filter_groups (DAPO dynamic sampling) needs a group estimator "
                      f"({sorted(GROUP_ESTIMATORS)})")
    if cfg.cost_model is not None and algo.adv_estimator == "gae":
        errors.append("Safe-RLHF (cost_model) is supported with critic-free estimators only (e.g. grpo, "
                      "reinforce_pp): the cost has no value head here")
    if algo.use_kl_in_reward and actor.use_kl_loss:
        errors.append("algorithm.use_kl_in_reward and actor.use_kl_loss are both on: choose one KL term")
    max_seq_len = getattr(rollout.engine, "max_seq_len", None)
    if max_seq_len is not None and data.max_prompt_length + rollout.max_tokens > max_seq_len:
        errors.append(f"data.max_prompt_length ({data.max_prompt_length}) + rollout.max_tokens ({rollout.max_tokens}) "
                      f"exceeds rollout.engine.max_seq_len ({max_seq_len})")
    if not data.train_files:
        errors.append("data.train_files is empty")
    for key in ("train_files", "val_files"):
        missing = [f for f in getattr(data, key) if not os.path.isfile(f)]
        if missing:
            made_by = " (made by tools/prepare_gsm8k.py)" if any("gsm8k" in str(f) for f in missing) else ""
            errors.append(f"data.{key}: no such file(s) {missing}{made_by} (relative paths are from {os.getcwd()})")
    for role in ("actor", "critic"):
        section = getattr(cfg, role)
        if section is not None and section.loss_agg_mode not in algorithms.AGG_MODES:
            errors.append(f"{role}.loss_agg_mode: unknown {section.loss_agg_mode!r}; valid: {list(algorithms.AGG_MODES)}")
    try:
        check_rollout_is(actor.rollout_is, actor.rollout_is_mode, actor.rollout_is_threshold)
    except ValueError as e:
        errors.append(f"actor.{e}")
    if cfg.trainer.test_freq > 0 and not data.val_files:
        errors.append("trainer.test_freq > 0 needs data.val_files")
    for role, ranks in role_ranks(cfg, world_size).items():
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad or len(set(ranks)) != len(ranks) or not ranks:
            errors.append(f"placement.{role}: ranks {ranks} must be distinct and in [0, {world_size}) "
                          f"(the job has {world_size} ranks)")
    if not errors:
        ranks = role_ranks(cfg, world_size)
        if ranks["rollout"] != ranks["actor"] and set(ranks["rollout"]) & set(ranks["actor"]):
            errors.append(f"placement.rollout {ranks['rollout']} overlaps placement.actor {ranks['actor']}: a rollout "
                          "is either colocated with the actor (same ranks, or null) or on ranks of its own")
        if rollout.tp_size < 1 or len(ranks["rollout"]) % rollout.tp_size:
            errors.append(f"rollout.tp_size={rollout.tp_size} must divide the rollout's {len(ranks['rollout'])} ranks")
        if rollout.weight_sync_bucket_mb < 1:
            errors.append(f"rollout.weight_sync_bucket_mb must be >= 1, got {rollout.weight_sync_bucket_mb}")
        errors += _batch_size_errors(cfg, ranks)
        if cfg.trainer.mode == "async":
            errors += _async_errors(cfg, ranks)
    if errors:
        raise ConfigError("inconsistent config:\n" + "\n".join(f"  - {e}" for e in errors))


def _async_errors(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> list[str]:
    """What asynchronous training needs: rollout ranks of their own, and estimators without extra generation."""
    a, errors = cfg.async_training, []
    if ranks["rollout"] == ranks["actor"]:
        errors.append("trainer.mode=async generates while the actor trains: give the rollout ranks of its own "
                      "(placement.rollout disjoint from placement.actor)")
    if a.max_staleness < 0:
        errors.append(f"async_training.max_staleness must be >= 0, got {a.max_staleness}")
    if not 1 <= a.prompts_per_call <= cfg.data.train_batch_size:
        errors.append(f"async_training.prompts_per_call must be in [1, data.train_batch_size="
                      f"{cfg.data.train_batch_size}], got {a.prompts_per_call}")
    if a.partial_rollout:
        engine = get_component(getattr(cfg.rollout.engine, "_component_", None) or "torchrlhf.generation.NativeEngine")
        if a.schedule != "stream" or cfg.rollout.tp_size != 1:
            errors.append("async_training.partial_rollout needs async_training.schedule=stream and rollout.tp_size=1 "
                          "(the ranks of a TP group could not agree on when to swap weights mid-trajectory)")
        if "between_steps" not in inspect.signature(engine.generate).parameters:
            errors.append(f"async_training.partial_rollout: {engine.__name__}.generate cannot load weights between "
                          "decode steps (no between_steps argument); the native engine can")
    if cfg.algorithm.filter_groups and a.schedule == "deterministic":
        errors.append("algorithm.filter_groups (DAPO dynamic sampling) needs async_training.schedule=stream: the "
                      "deterministic schedule trains exactly the sampler's t-th batch at step t")
    if cfg.algorithm.filter_groups and cfg.reward_model is not None:
        errors.append("algorithm.filter_groups with trainer.mode=async filters groups on the rule rewards as they "
                      "return; a reward model scores on the trainer's thread, so drop one of them")
    if cfg.algorithm.adv_estimator == "remax":
        if a.schedule == "deterministic":
            errors.append("algorithm.adv_estimator=remax with trainer.mode=async needs async_training.schedule="
                          "stream (each replica generates its greedy baselines right after its samples)")
        if cfg.reward_model is not None:
            errors.append("algorithm.adv_estimator=remax with trainer.mode=async scores the greedy baselines "
                          "with the rule reward on the rollout thread; a reward model cannot score there")
    return errors


def _batch_size_errors(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> list[str]:
    from torchrlhf.workers import validate_batch_sizes

    errors = []
    sections = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.critic is not None else [])
    for role, sec in sections:
        if len(ranks[role]) % sec.tp_size:
            errors.append(f"{role}.tp_size={sec.tp_size} must divide the role's {len(ranks[role])} ranks")
            continue
        try:
            validate_batch_sizes(
                ppo_mini_batch_size=sec.ppo_mini_batch_size, rollout_n=cfg.rollout.n,
                dp_size=len(ranks[role]) // sec.tp_size,
                ppo_micro_batch_size_per_device=sec.ppo_micro_batch_size_per_device,
                train_batch_size=cfg.data.train_batch_size, use_dynamic_bsz=sec.use_dynamic_bsz,
                max_tokens_per_micro_batch=sec.max_tokens_per_micro_batch, role=role,
            )
        except ValueError as e:
            errors.append(str(e))
    return errors


def load_recipe_config(cfg: Any, world_size: int) -> Any:
    """Validate a loaded (OmegaConf) config against `RecipeConfig` and the cross-section checks."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"a recipe config must be a mapping, got {type(cfg).__name__}")
    container = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    moved = [f"{old}: moved to {new}" for old, new in MOVED_KEYS.items()
             if isinstance(container.get(old.split(".")[0]), Mapping) and old.split(".")[1] in container[old.split(".")[0]]]
    if moved:
        raise ConfigError("config keys that moved (the engine is now its own section, rollout.engine):\n"
                          + "\n".join(f"  - {m}" for m in moved))
    recipe = validate(container, recipe_schema(chosen_components(container)))
    check(recipe, world_size)
    return recipe
