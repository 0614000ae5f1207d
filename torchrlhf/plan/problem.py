"""What a recipe config asks of one RL step, read once for the planner: models, dtypes, batch arithmetic, lengths.

Prompt lengths are the mean over the first rows of the training files, tokenized as a run tokenizes them; the
response length is ``rollout.max_tokens`` unless given (a synchronous generation lasts as long as its longest
response, and early in RL training responses run to the limit often).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from torchrlhf.data.dataset import PromptDataset
from torchrlhf.models import load_tokenizer
from torchrlhf.plan.simulate import Mapping, Problem, Role, Workload
from torchrlhf.trainer.explain import ModelShape, model_shape
from torchrlhf.trainer.schema import (
    RecipeConfig,
    distills,
    needs_old_log_prob,
    needs_reference,
    reference_is_actor,
    reference_kwargs,
    resolve_model_path,
    role_layouts,
    teacher_kwargs,
)

PROMPT_ROWS = 256  # rows tokenized for the mean prompt length


@dataclass(frozen=True)
class TracedRole:
    """How the memory model traces a role (`torchrlhf.plan.memory.micro_batch_memory`)."""

    model_path: str
    kind: str  # "train", "value" or "forward"
    dtype: torch.dtype
    lora: Any = None
    activation_checkpointing: bool = False
    optim: dict | None = None
    use_kl_loss: bool = False
    cpu_offload: bool = False


@dataclass(frozen=True)
class PlanInput:
    """A `Problem` (the simulator's numbers) and what the memory model traces, per role."""

    problem: Problem
    traced: dict[str, TracedRole]  # actor, ref (its own forward), critic, teacher, reward_model, cost_model
    engine_dtype_bytes: int
    max_prompt_len: int
    prompt_len_source: str  # where the workload's prompt length came from
    heads: dict[str, tuple[int, int]]  # role -> (attention heads, KV heads): TP must divide both
    dynamic_batching: dict[str, bool]  # trained role -> cuts micro-batches by tokens (``use_dynamic_bsz``)


def _optim(section: Any) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)}


def mean_prompt_length(cfg: RecipeConfig) -> tuple[float, str]:
    """Mean prompt tokens over the first `PROMPT_ROWS` training rows, and where the figure came from; the limit
    ``data.max_prompt_length`` without training files or a tokenizer (a model directory with a config only)."""
    data = cfg.data
    limit = float(data.max_prompt_length), "data.max_prompt_length (no training files)"
    if not data.train_files:
        return limit
    try:
        tokenizer = load_tokenizer(resolve_model_path(cfg.tokenizer_path or cfg.actor.model_path))
    except (OSError, ValueError):
        return float(data.max_prompt_length), "data.max_prompt_length (no tokenizer to measure the prompts)"
    prompts = PromptDataset(data.train_files, tokenizer, prompt_key=data.prompt_key,
                            max_prompt_length=data.max_prompt_length, apply_chat_template=data.apply_chat_template,
                            system_prompt=data.system_prompt, max_samples=PROMPT_ROWS)
    mean = sum(len(prompts[i]["input_ids"]) for i in range(len(prompts))) / len(prompts)
    return mean, f"the mean of the first {len(prompts)} training prompts"


def plan_input(cfg: RecipeConfig, *, prompt_len: float | None = None, response_len: float | None = None) -> PlanInput:
    """Read ``cfg`` (a validated recipe config) for the planner."""
    if cfg.judge is not None:
        raise ValueError("the planner does not model an LLM judge yet: plan without `judge`, then place it by hand")
    actor = cfg.actor
    shapes: dict[str, ModelShape] = {"actor": model_shape(resolve_model_path(actor.model_path), actor.lora)}
    optim = _optim(actor.optim)
    traced = {"actor": TracedRole(resolve_model_path(actor.model_path), "train", getattr(torch, actor.dtype), actor.lora,
                                  actor.memory.activation_checkpointing, optim, actor.loss.use_kl_loss,
                                  actor.memory.cpu_offload)}
    dtypes = {"actor": actor.dtype, "rollout": actor.dtype}
    heads = {}
    reference = needs_reference(cfg) and not reference_is_actor(cfg)
    if reference:
        ref = SimpleNamespace(**reference_kwargs(cfg))
        traced["ref"] = TracedRole(resolve_model_path(ref.model_path), "forward", getattr(torch, ref.dtype),
                                   cpu_offload=ref.memory.cpu_offload)
    if distills(cfg):
        teacher = SimpleNamespace(**teacher_kwargs(cfg))
        shapes["teacher"] = model_shape(resolve_model_path(teacher.model_path))
        traced["teacher"] = TracedRole(resolve_model_path(teacher.model_path), "forward", getattr(torch, teacher.dtype),
                                       cpu_offload=teacher.memory.cpu_offload)
        dtypes["teacher"] = teacher.dtype
    mini_batches = {"actor": cfg.data.train_batch_size // actor.batching.ppo_mini_batch_size}
    epochs = {"actor": actor.batching.ppo_epochs}
    shared = {"actor": actor.shared_prefix, "critic": False}
    if cfg.critic is not None:
        c = cfg.critic
        shapes["critic"] = model_shape(resolve_model_path(c.model_path), value_head=True)
        c_optim = _optim(c.optim)
        traced["critic"] = TracedRole(resolve_model_path(c.model_path), "value", getattr(torch, c.dtype), None,
                                      c.memory.activation_checkpointing, c_optim, cpu_offload=c.memory.cpu_offload)
        dtypes["critic"] = c.dtype
        mini_batches["critic"] = cfg.data.train_batch_size // c.batching.ppo_mini_batch_size
        epochs["critic"] = c.batching.ppo_epochs
        shared["critic"] = c.shared_prefix
    for scorer in ("reward_model", "cost_model"):
        sec = getattr(cfg, scorer)
        if sec is not None:
            shapes[scorer] = model_shape(resolve_model_path(sec.model_path), value_head=True)
            traced[scorer] = TracedRole(resolve_model_path(sec.model_path), "forward", getattr(torch, sec.dtype))
            dtypes[scorer] = sec.dtype
    for role, shape in shapes.items():
        heads[role] = (shape.flops.heads, shape.kv_heads)
    engine = cfg.rollout.engine
    p_max, r_max = cfg.data.max_prompt_length, cfg.rollout.max_tokens
    prompt_source = "given"
    if prompt_len is None:
        prompt_len, prompt_source = mean_prompt_length(cfg)
    workload = Workload(
        prompts=cfg.data.train_batch_size, n=cfg.rollout.n, prompt_len=prompt_len,
        response_len=response_len if response_len is not None else float(r_max), longest_response=r_max)
    problem = Problem(
        models=shapes, dtypes=dtypes, workload=workload, mini_batches=mini_batches, epochs=epochs,
        old_log_prob=needs_old_log_prob(cfg), reference=reference, shared_prefix=shared,
        max_slots=getattr(engine, "max_batch_size", None) or 256,
        max_seq_len=getattr(engine, "max_seq_len", None) or p_max + r_max)
    return PlanInput(problem, traced, torch.empty((), dtype=getattr(torch, actor.dtype)).element_size(),
                     p_max, prompt_source, heads,
                     {role: getattr(cfg, role).batching.use_dynamic_bsz for role in mini_batches})




def config_mapping(cfg: RecipeConfig, world_size: int) -> Mapping:
    """The mapping ``cfg`` itself asks for: its roles' ranks and TP sizes (`role_layouts`), micro-batches, schedule."""
    layouts = role_layouts(cfg, world_size)
    p_len, r_len = cfg.data.max_prompt_length, cfg.rollout.max_tokens

    def micro(batching: Any) -> tuple[int, int]:
        if batching.use_dynamic_bsz:
            rows = max(1, batching.max_tokens_per_micro_batch // (p_len + r_len))
            return rows, rows
        return batching.ppo_micro_batch_size_per_device, batching.log_prob_micro_batch_size

    roles = {}
    for role, layout in layouts.items():
        if role == "ref":
            continue
        ranks = list(layout.ranks)
        sizes = micro(getattr(cfg, role).batching) if role in ("actor", "critic") else (1, 1)
        roles[role] = Role(len(ranks), min(ranks), layout.dims.tp, *sizes, ep=layout.dims.ep)
    if roles["rollout"].ranks == roles["actor"].ranks and roles["rollout"].first == roles["actor"].first:
        a = roles["actor"]  # a colocated engine's TP group is rollout.tp_size ranks of the actor's mesh
        roles["rollout"] = Role(a.ranks, a.first, cfg.rollout.tp_size)
    a = cfg.async_training
    return Mapping(roles, cfg.trainer.mode, a.max_staleness if cfg.trainer.mode == "async" else 0, a.prompts_per_call)


__all__ = ["PlanInput", "TracedRole", "config_mapping", "mean_prompt_length", "plan_input"]
