"""From a validated `RecipeConfig` to a ready `RLTrainer`: tokenizer, prompts, worker groups, reward, logger.

Runs on the controller (rank 0) after `launch`; worker groups are created here, collectively, through
the runtime. Roles placed on the same ranks are colocated in one process per rank.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torchrlhf.data.dataset import PromptDataset
from torchrlhf import algorithms
from torchrlhf.models import load_tokenizer
from torchrlhf.config import get_component
from torchrlhf.runtime import colocate, set_stall_timeout
from torchrlhf.runtime.profiling import StepProfiler
from torchrlhf.trainer.checkpointing import run_fingerprint
from torchrlhf.trainer.prompts import PromptLoader
from torchrlhf.rollouts import (
    DeterministicRollouts,
    GroupFilter,
    Repack,
    Replicas,
    RolloutPipeline,
    RolloutSource,
    Scorer,
    StreamRollouts,
    SyncRollouts,
    WeightSync,
)
from torchrlhf.trainer.rl_trainer import RLTrainer, Roles
from torchrlhf.trainer.schema import (
    MODEL_SCORERS,
    RecipeConfig,
    models_in_unit,
    distills,
    needs_reference,
    needs_old_log_prob,
    reference_is_actor,
    reference_kwargs,
    resolve_model_path,
    role_layouts,
    role_ranks,
    section_kwargs,
    teacher_kwargs,
)
from torchrlhf.utils.logging import build_logger
from torchrlhf.workers import ActorWorker, RolloutWorker


def role_specs(cfg: RecipeConfig, world_size: int) -> dict[str, tuple]:
    """role -> (worker class, args, kwargs), with model paths resolved and derived keys filled in.

    The reference and the distillation teacher are always the library's `ActorWorker` (frozen): they only
    compute log-probs; a LoRA actor serves the reference itself (no reference role), never the teacher. The rollout comes right after the actor: colocated, it reads the
    actor worker built before it in the same process.
    """
    actor = {**section_kwargs(cfg, "actor"), "model_path": resolve_model_path(cfg.actor.model_path)}
    specs: dict[str, tuple] = {"actor": (get_component(cfg.actor._component_), (), actor)}
    ranks = role_ranks(cfg, world_size)
    engine = {f.name: getattr(cfg.rollout.engine, f.name) for f in dataclasses.fields(cfg.rollout.engine)}
    agent = cfg.rollout.agent
    specs["rollout"] = (RolloutWorker, (), {
        "model_path": actor["model_path"], "engine": engine, "tp_size": cfg.rollout.tp_size, "dtype": actor["dtype"],
        "actor_group": "actor" if ranks["rollout"] == ranks["actor"] else None, "lora": actor["lora"],
        "agent": agent, "max_tokens": cfg.rollout.max_tokens,  # the typed spec: loaded once, on the rollout ranks
        "offload_optimizer": cfg.rollout.offload_optimizer,
    })
    if needs_reference(cfg) and not reference_is_actor(cfg):
        ref = reference_kwargs(cfg)
        specs["ref"] = (ActorWorker, (), {**ref, "model_path": resolve_model_path(ref["model_path"])})
    if distills(cfg):
        teacher = teacher_kwargs(cfg)
        specs["teacher"] = (ActorWorker, (), {**teacher, "model_path": resolve_model_path(teacher["model_path"])})
    for role in ("critic", *MODEL_SCORERS):
        section = getattr(cfg, role)
        if section is not None:
            kwargs = {**section_kwargs(cfg, role), "model_path": resolve_model_path(section.model_path)}
            specs[role] = (get_component(section._component_), (), kwargs)
    return specs


def may_lose_rollout_replicas(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> bool:
    """Whether a rollout rank that dies is dropped and training goes on: asynchronous training (either
    schedule), no other role on the rollout ranks (it would die with them), and
    ``async_training.tolerate_rollout_failures``. With ``rollout.tp_size`` > 1 its whole replica is dropped
    (its TP peers cannot generate alone)."""
    a = cfg.async_training
    shared = any(set(r) & set(ranks["rollout"]) for role, r in ranks.items() if role != "rollout")
    return cfg.trainer.mode == "async" and a.tolerate_rollout_failures and not shared


def build_groups(cfg: RecipeConfig, world_size: int) -> dict[str, Any]:
    """Create the worker groups: one `colocate` call per distinct rank set (in a fixed order on every run), each
    role laid out as `role_layouts` says."""
    specs = role_specs(cfg, world_size)
    layouts = role_layouts(cfg, world_size)
    by_ranks: dict[tuple[int, ...], dict[str, tuple]] = {}
    for role, spec in specs.items():
        by_ranks.setdefault(layouts[role].ranks, {})[role] = spec
    groups: dict[str, Any] = {}
    for rank_set, roles in by_ranks.items():
        groups.update(colocate(roles, list(rank_set), parallel_dims={role: layouts[role].dims for role in roles}))
    return groups


def build_scorer(cfg: RecipeConfig, groups: dict[str, Any], reward_fn: Any) -> Scorer:
    algo = cfg.algorithm
    return Scorer(reward_fn, reward_model=groups.get("reward_model"), cost_model=groups.get("cost_model"),
                  judge=groups.get("judge"), rule_weight=cfg.reward.weight,
                  judge_weight=cfg.judge.weight if cfg.judge is not None else 1.0,
                  max_tokens=cfg.rollout.max_tokens, overlong_buffer=algo.overlong_buffer, agent=cfg.rollout.agent)


def build_rollouts(cfg: RecipeConfig, world_size: int, groups: dict[str, Any], scorer: Scorer,
                   prompts: PromptLoader) -> RolloutSource:
    """The rollout source of ``trainer.mode`` / ``async_training.schedule``, over the built groups."""
    ranks = role_ranks(cfg, world_size)
    colocated = ranks["rollout"] == ranks["actor"]
    replicas = Replicas(groups["rollout"], colocated=colocated, pad_id=prompts.pad_id,
                        lose_replicas=may_lose_rollout_replicas(cfg, ranks))
    algo, a = cfg.algorithm, cfg.async_training
    filtering = algo.filter_groups
    group_filter = GroupFilter(cfg.rollout.n, max(1, filtering.max_num_gen_batches) * cfg.data.train_batch_size) \
        if filtering.enable else None
    greedy_baseline = algorithms.ADV_ESTIMATORS[algo.adv_estimator].greedy_baseline
    pipeline = RolloutPipeline(scorer, cfg.rollout.sampling(), remax=greedy_baseline,
                               group_filter=group_filter, models_in_unit=models_in_unit(cfg, world_size))
    weight_sync = None if colocated else WeightSync(
        groups["actor"], replicas, dtype=cfg.actor.dtype, bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20,
        relay_capacity=a.max_staleness + 2)
    common = dict(weight_sync=weight_sync, seed=cfg.trainer.seed)
    if cfg.trainer.mode == "sync":
        return SyncRollouts(pipeline, replicas, prompts, **common)
    if a.schedule == "deterministic":
        return DeterministicRollouts(pipeline, replicas, prompts, max_staleness=a.max_staleness,
                                     warmup=cfg.trainer.critic_warmup, **common)
    repack = Repack(cfg.rollout.n, a.repack.min_active_fraction, a.repack.long_tail_replicas,
                    partial=a.partial_rollout, pad_id=prompts.pad_id) if a.repack.enable else None
    return StreamRollouts(pipeline, replicas, prompts, max_staleness=a.max_staleness,
                          prompts_per_call=a.prompts_per_call, stale_policy=a.stale_policy,
                          partial_rollout=a.partial_rollout, repack=repack, **common)


def build_prompts(cfg: RecipeConfig, tokenizer: Any) -> tuple[PromptLoader, PromptLoader | None]:
    data = cfg.data
    common = dict(prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                  apply_chat_template=data.apply_chat_template, system_prompt=data.system_prompt)
    train_files, val_files = data.train_files, data.val_files
    if cfg.rollout.agent is not None and cfg.rollout.agent.verifiers:  # the environment's dataset is the prompts
        from torchrlhf.agents.verifiers_env import verifiers_data_files

        train_files, val_files = verifiers_data_files(cfg.rollout.agent.verifiers, cfg.trainer.output_dir, val_files)
    train = PromptDataset(train_files, tokenizer, max_samples=data.max_samples, **common)
    train_loader = PromptLoader(train, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    if not val_files:
        return train_loader, None
    val = PromptDataset(val_files, tokenizer, max_samples=data.val_max_samples, **common)
    return train_loader, PromptLoader(val, data.val_batch_size, shuffle=False, drop_last=False)


def build_trainer(cfg: RecipeConfig, world_size: int, raw_config: dict[str, Any] | None = None) -> RLTrainer:
    """Everything a run needs, built in dependency order (data first: a bad file fails before models load)."""
    set_stall_timeout(cfg.trainer.stall_timeout_s)
    tokenizer = load_tokenizer(resolve_model_path(cfg.tokenizer_path or cfg.actor.model_path))
    train_prompts, val_prompts = build_prompts(cfg, tokenizer)
    reward_fn = get_component(cfg.reward._component_)(**section_kwargs(cfg, "reward", tokenizer=tokenizer))
    os.makedirs(cfg.trainer.output_dir, exist_ok=True)
    logger = build_logger(cfg.trainer.loggers, log_dir=cfg.trainer.output_dir, total_steps=cfg.trainer.total_steps,
                          project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name, config=raw_config)
    groups = build_groups(cfg, world_size)
    scorer = build_scorer(cfg, groups, reward_fn)
    rollouts = build_rollouts(cfg, world_size, groups, scorer, train_prompts)
    ref = groups["actor"] if reference_is_actor(cfg) else groups.get("ref")
    roles = Roles(actor=groups["actor"], ref=ref, critic=groups.get("critic"), rollout=groups["rollout"],
                  teacher=groups.get("teacher"))
    profile = cfg.trainer.profile
    profiler = StepProfiler(profile.steps, {role: groups[role] for role in profile.roles or groups},
                            profile.dir or os.path.join(cfg.trainer.output_dir, "profile"))
    return RLTrainer(algorithm=cfg.algorithm, rollout_cfg=cfg.rollout, trainer_cfg=cfg.trainer, roles=roles,
                     source=rollouts, scorer=scorer, train_prompts=train_prompts, val_prompts=val_prompts,
                     logger=logger, num_devices=world_size, recompute_old_log_prob=needs_old_log_prob(cfg),
                     max_staleness=cfg.async_training.max_staleness if cfg.trainer.mode == "async" else 0,
                     safe_rlhf=cfg.cost_model is not None, profiler=profiler,
                     fingerprint=run_fingerprint(raw_config if raw_config is not None else repr(cfg), world_size))
