"""What a config will do, without loading weights: ranks and meshes, batch arithmetic, memory per rank.

    python recipes/ppo.py --config X.yaml --dry-run [--world-size 8] [key=value ...]

or, in a notebook, ``print(explain(load_recipe_config(raw, world_size), world_size))``. The config is
validated exactly as a real run validates it (the same errors), then every role's ranks and device
mesh, the samples per step, the mini-batches and optimizer steps per rollout, the micro-batches and
gradient-accumulation steps per rank, a bound on the tokens of one micro-batch, and an estimate of
each rank's memory are printed. Parameter counts come from the model's ``config.json`` (built on the
meta device), so nothing heavy is read.

The training roles' memory (actor, reference, critic) is traced, not counted by hand: one micro-batch
of the longest prompts and responses runs forward (+ backward and an optimizer step for a trained role)
through the role's model on fake tensors (`torchrlhf.trainer.memory`), and the peak is printed by kind
(parameters, gradients, optimizer states, activations, temporaries), with parameters, gradients and
optimizer states recounted as FSDP2's float32 shards over the role's ranks. The rollout engine's weights
(streamed in from training when colocated, a full TP shard of its own otherwise) and its KV cache are
still counted from their formulas (slots × tokens × layers × KV heads × head dim), not traced.

A rank's total is what it holds throughout a step (parameters, buffers and optimizer states; an engine on
ranks of its own) plus the largest working set of one role's calls (gradients, activations, temporaries;
a colocated engine's weights and KV cache, freed after generation): in sync mode the controller calls the
roles one after another. In async mode every role's memory adds up.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from torchrlhf.models.lora import inject_lora, is_adapter
from torchrlhf.models.heads import build_meta_value_model
from torchrlhf.models.moe import expert_weights, install_routers, routers
from torchrlhf.models.parallelize import model_layout
from torchrlhf.trainer.memory import (WORKING_KINDS, as_held, run_device_type, shared_prefix_shape,
                                      trace_micro_batch, trace_shared_prefix_update)
from torchrlhf.trainer.schema import (
    RecipeConfig,
    distills,
    needs_reference,
    RoleLayout,
    needs_old_log_prob,
    reference_is_actor,
    reference_kwargs,
    resolve_model_path,
    role_layouts,
    teacher_kwargs,
)
from torchrlhf.utils.flops import TransformerFlops, generation_counts
from torchrlhf.workers.shared_prefix import layout_counts

GIB = 1 << 30


@dataclass
class ModelShape:
    """What the estimates need from a ``config.json``."""

    params: int
    layers: int
    hidden: int
    vocab: int
    kv_heads: int
    head_dim: int
    flops: TransformerFlops  # the model FLOP counts of `torchrlhf.utils.flops`
    adapter_params: int = 0  # with ``lora``: the adapters' parameters (``params`` counts the base only)
    model_type: str = ""  # config.json's, which decides whether tensor parallelism has a plan for it
    experts: int = 0  # a mixture-of-experts model's routed experts per sparse block (0: dense)
    top_k: int = 0  # experts each token runs
    expert_params: int = 0  # every routed expert's weights over all layers (included in ``params``)
    tensors: int = 0  # parameter tensors (tied ones once, adapters left out): a weight sync moves them one by one

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Keys and values of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


def model_shape(path: str, lora: Any = None, value_head: bool = False) -> ModelShape:
    """Parameter count and dimensions from the model directory's config, built on the meta device (with the
    adapters of ``lora``, a `LoRAConfig`, when given). ``value_head``: the `ValueModel` a critic or a reward model
    runs, whose head scores each position with one output where the LM head projects onto the vocabulary."""
    config = transformers.AutoConfig.from_pretrained(path)
    if value_head:
        model = build_meta_value_model(path)  # installs its routers
        moe = bool(routers(model))
    else:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        moe = install_routers(model) > 0  # FLOPs count a mixture-of-experts model's active experts
    if lora is not None:
        inject_lora(model, lora)
    heads = config.num_attention_heads
    return ModelShape(
        params=sum(p.numel() for n, p in model.named_parameters() if not is_adapter(n)),
        adapter_params=sum(p.numel() for n, p in model.named_parameters() if is_adapter(n)),
        layers=config.num_hidden_layers, hidden=config.hidden_size, vocab=config.vocab_size,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        flops=TransformerFlops.from_model(model),
        model_type=config.model_type,
        experts=config.num_experts if moe else 0, top_k=config.num_experts_per_tok if moe else 0,
        expert_params=expert_weights(model),
        tensors=sum(1 for n, _ in model.named_parameters() if not is_adapter(n)),
    )


def _bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _ranks(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _trainer_lines(role: str, sec: Any, cfg: RecipeConfig, layout: RoleLayout, shape: ModelShape, model_path: str,
                   frozen: bool = False) -> tuple[list[str], dict[int, float]]:
    """Batch arithmetic and per-rank memory of a trainable role (actor, critic) or a frozen one (the
    reference, the teacher)."""
    ranks, tp, dp, ep = list(layout.ranks), layout.dims.tp, layout.dims.dp, layout.dims.ep
    n, prompts = cfg.rollout.n, cfg.data.train_batch_size
    samples = prompts * n
    lora = getattr(sec, "lora", None)
    dtype = getattr(torch, sec.dtype)
    layout = model_layout(dp * tp, dtype, trainable=not frozen, cpu_offload=sec.memory.cpu_offload,
                          lora=lora is not None)
    experts = (f"; experts split over EP {ep} (each rank's FSDP2-sharded over {dp // ep}; tokens to their experts "
               "by all-to-all)") if ep > 1 else ""
    held = {"fsdp": f"FSDP2 over {dp} × TP {tp} (mesh dp_shard={dp}, tp={tp}){experts}",
            "copies": f"one rank, float32 weights and {sec.dtype} compute copies (no FSDP2)",
            "plain": "one rank, the plain module (no FSDP2)"}[layout]
    lines = [f"  {role:<9} ranks {_ranks(ranks)}: {held}, {shape.params / 1e6:.1f} M parameters, computing in {sec.dtype}"]
    if lora is not None:
        lines.append(f"      LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {lora.target_modules}: "
                     f"{shape.adapter_params / 1e6:.2f} M trainable float32 parameters "
                     f"({100 * shape.adapter_params / shape.params:.2f} % of the frozen base)")
    p_len, r_len = cfg.data.max_prompt_length, cfg.rollout.max_tokens
    batching = sec.batching
    if frozen:
        micro = batching.log_prob_micro_batch_size
        per_rank = math.ceil(samples / dp)
        lines.append(f"      log-probs: {per_rank} samples per rank in {math.ceil(per_rank / micro)} micro-batch(es) "
                     f"of ≤ {micro}")
    else:
        mini = prompts // batching.ppo_mini_batch_size
        per_rank = batching.ppo_mini_batch_size * n // dp
        micro = batching.ppo_micro_batch_size_per_device
        lines.append(f"      update: {mini} mini-batch(es) of {batching.ppo_mini_batch_size} prompts × "
                     f"{batching.ppo_epochs} epoch(s) = {mini * batching.ppo_epochs} optimizer step(s) per training step")
        if batching.use_dynamic_bsz:
            lines.append(f"      per rank per mini-batch: {per_rank} samples, micro-batches by token budget "
                         f"(≤ {batching.max_tokens_per_micro_batch} tokens each)")
        else:
            lines.append(f"      per rank per mini-batch: {per_rank} samples in {math.ceil(per_rank / micro)} "
                         f"micro-batch(es) of ≤ {micro} = {math.ceil(per_rank / micro)} gradient-accumulation "
                         "step(s)")
    shared = sec.shared_prefix
    micro_tokens = batching.max_tokens
    if micro_tokens is None:
        micro_tokens = micro * (1 + r_len) if shared else micro * (p_len + r_len)
    rows_are = "[last prompt token] + response, prompts once per mini-batch" if shared else "prompt + response, padded"
    lines.append(f"      tokens per micro-batch ≤ {micro_tokens} ({rows_are})")

    # traced on fake tensors (`trainer.memory`), at the longest prompts and responses
    trace_kw = dict(dtype=dtype, value_head=role == "critic", lora=lora,
                    activation_checkpointing=sec.memory.activation_checkpointing,
                    optim=None if frozen else {f.name: getattr(sec.optim, f.name) for f in dataclasses.fields(sec.optim)},
                    use_kl_loss=role == "actor" and sec.loss.use_kl_loss, device_type=run_device_type())
    if shared:
        # The prompts' pass covers every distinct prompt the rank holds (a mini-batch's in an update, the step's in a
        # no-grad pass) and its keys/values (and, training, its graph) live through every suffix micro-batch.
        part = shared_prefix_shape(batching, n=n, dp=dp, step_prompts=prompts, response_len=r_len, frozen=frozen)
        offload = not frozen and sec.memory.offload_prefix_activations
        traced = trace_shared_prefix_update(model_path, **part, prompt_len=p_len, response_len=r_len, offload=offload,
                                            train=not frozen, **trace_kw)
        host = traced.pop("offloaded")
        what = (f"{part['prompts']} prompt(s) of {p_len} tokens once, then suffix micro-batches of {part['micro']} × "
                f"(1 + {r_len}) tokens")
        if offload:
            what += f" (the prompts' pass's activations offloaded: {_gib(host)} of host memory per rank)"
    else:
        if batching.use_dynamic_bsz:
            micro = max(1, micro_tokens // (p_len + r_len))
        # a second micro-batch of the mini-batch runs beside the first one's gradients
        traced = trace_micro_batch(model_path, micro=micro, prompt_len=p_len, response_len=r_len, train=not frozen,
                                   accumulating=not frozen and per_rank > micro, **trace_kw)
        what = f"one micro-batch of {micro} × ({p_len} + {r_len}) tokens"
    memory = as_held(traced, dtype=dtype, shards=dp * tp, tp=tp, layout=layout, lora=lora is not None)
    lines.append(f"      memory traced: {what}, "
                 + ("forward" if frozen else "forward + backward + optimizer step")
                 + f" on fake tensors, peak {_gib(sum(memory.values()))} per rank"
                 + {"fsdp": " (parameters, gradients and optimizer states as FSDP2's float32 shards)",
                    "copies": " (parameters, gradients and optimizer states in float32, and the compute copies)",
                    "plain": ""}[layout])
    return lines, memory


def _pass_flops(model: TransformerFlops, cfg: RecipeConfig, sec: Any, layout: RoleLayout, mini_batches: int,
                train: bool = False) -> float:
    """Model FLOPs of one forward (``train``: forward + backward) over a step's samples, at the longest prompts and responses, as the role
    computes them: each data-parallel rank its contiguous shard, in strided mini-batches (`layout_counts`
    of each; with shared prompts, a prompt recurs in every mini-batch and on every rank that has one of its
    samples)."""
    n, samples = cfg.rollout.n, cfg.data.train_batch_size * cfg.rollout.n
    p_len, r_len = cfg.data.max_prompt_length, cfg.rollout.max_tokens
    dp = layout.dims.dp
    shard = math.ceil(samples / dp)
    total = 0
    for r in range(dp):
        rows = range(r * shard, min((r + 1) * shard, samples))
        for part in (rows[j::mini_batches] for j in range(mini_batches)):
            if not part:
                continue
            if sec.shared_prefix:
                groups = {g: k for k, g in enumerate(sorted({i // n for i in part}))}
                counts = layout_counts([p_len] * len(groups), [r_len] * len(part), [groups[i // n] for i in part])
            else:
                counts = layout_counts([p_len] * len(part), [r_len] * len(part), None)
            total += model.train(*counts) if train else model.forward(*counts)
    return total


def _flops_lines(cfg: RecipeConfig, layouts: dict[str, RoleLayout], shapes: dict[str, ModelShape]) -> list[str]:
    """Model FLOPs per step of every pass (`torchrlhf.utils.flops`, what ``perf/mfu/*`` divides by the
    time and the peak), at the longest prompts and responses: an upper bound."""
    actor, batching, lm = cfg.actor, cfg.actor.batching, shapes["actor"].flops
    minis = cfg.data.train_batch_size // batching.ppo_mini_batch_size
    passes = {"actor update": batching.ppo_epochs * _pass_flops(lm, cfg, actor, layouts["actor"], minis, train=True)}
    if needs_old_log_prob(cfg):
        passes["old log-probs"] = _pass_flops(lm, cfg, actor, layouts["actor"], 1)
    for role, kwargs in (("ref", reference_kwargs), ("teacher", teacher_kwargs)):
        if role in shapes:
            passes[role] = _pass_flops(shapes[role].flops, cfg, SimpleNamespace(**kwargs(cfg)), layouts[role], 1)
    if "critic" in shapes:
        value = dataclasses.replace(shapes["critic"].flops, head_out=1)
        c_minis = cfg.data.train_batch_size // cfg.critic.batching.ppo_mini_batch_size
        passes["critic update"] = cfg.critic.batching.ppo_epochs * _pass_flops(
            value, cfg, cfg.critic, layouts["critic"], c_minis, train=True)
        passes["values"] = _pass_flops(value, cfg, cfg.critic, layouts["critic"], 1)
    prompts = cfg.data.train_batch_size
    engine = dataclasses.replace(lm, adapter_params=0)  # a LoRA actor's engine holds merged weights
    passes["rollout"] = engine.forward(*generation_counts([cfg.data.max_prompt_length] * prompts,
                                                          [cfg.rollout.max_tokens] * prompts * cfg.rollout.n))
    return ["model FLOPs per step (fwd + bwd of the tokens processed, at the longest prompts and responses: "
            "an upper bound; perf/mfu/* divide the measured ones by time × peak):",
            "  " + ", ".join(f"{k} {v / 1e12:.3g} TFLOP" for k, v in passes.items())
            + f"; total {sum(passes.values()) / 1e12:.3g} TFLOP"]


def explain(cfg: RecipeConfig, world_size: int) -> str:
    """The dry-run report of a validated config (see the module docstring)."""
    layouts = role_layouts(cfg, world_size)
    ranks = {role: list(layout.ranks) for role, layout in layouts.items()}
    shape = model_shape(resolve_model_path(cfg.actor.model_path), cfg.actor.lora)
    out = [f"torchrlhf dry run: world size {world_size}, rank 0 is the controller"]
    n, prompts = cfg.rollout.n, cfg.data.train_batch_size
    out.append(f"per step: {prompts} prompts × n {n} = {prompts * n} samples, responses ≤ {cfg.rollout.max_tokens} "
               f"tokens, prompts ≤ {cfg.data.max_prompt_length} tokens; {cfg.trainer.total_steps} steps, "
               f"mode {cfg.trainer.mode}")
    out.append("roles:")
    per_rank: dict[int, dict[str, float]] = {r: {} for r in range(world_size)}
    # Which phase of a step each item is working memory of (absent: held throughout the step). The
    # controller calls the roles one after another, so in sync mode the roles' phases never overlap.
    phase_of: dict[int, dict[str, str]] = {r: {} for r in range(world_size)}
    sync = cfg.trainer.mode == "sync"

    def add(role: str, role_ranks_: list[int], memory: dict[str, float], working: tuple[str, ...] = ()) -> None:
        """``working``: the kinds ``role`` holds only during its own calls."""
        for r in role_ranks_:
            for k, v in memory.items():
                per_rank[r][f"{role} {k}"] = v
                if sync and k in working:
                    phase_of[r][f"{role} {k}"] = role

    shapes = {"actor": shape}  # each role's, for the FLOPs per step
    lines, mem = _trainer_lines("actor", cfg.actor, cfg, layouts["actor"], shape,
                               resolve_model_path(cfg.actor.model_path))
    out += lines
    add("actor", ranks["actor"], mem, working=WORKING_KINDS)
    if reference_is_actor(cfg):
        out.append("  ref       served by the actor: its base model with the adapters off (no second model)")
    elif needs_reference(cfg):
        ref = SimpleNamespace(**reference_kwargs(cfg))
        ref_shape = model_shape(resolve_model_path(ref.model_path)) if cfg.ref.model_path else shape
        shapes["ref"] = ref_shape
        lines, mem = _trainer_lines("ref", ref, cfg, layouts["ref"], ref_shape, resolve_model_path(ref.model_path),
                                   frozen=True)
        out += lines
        add("ref", ranks["ref"], {} if ref.memory.cpu_offload else mem, working=WORKING_KINDS)
    if distills(cfg):
        teacher = SimpleNamespace(**teacher_kwargs(cfg))
        teacher_path = resolve_model_path(teacher.model_path)
        shapes["teacher"] = model_shape(teacher_path)
        lines, mem = _trainer_lines("teacher", teacher, cfg, layouts["teacher"], shapes["teacher"], teacher_path,
                                    frozen=True)
        d = cfg.algorithm.distill
        out += lines + [f"      distillation: A = {d.task_coef:g} × A_task + {d.coef:g} × (log p_teacher − log p_student) "
                        "per sampled token"]
        add("teacher", ranks["teacher"], {} if teacher.memory.cpu_offload else mem, working=WORKING_KINDS)
    if cfg.critic is not None:
        critic_shape = model_shape(resolve_model_path(cfg.critic.model_path), value_head=True)
        shapes["critic"] = critic_shape
        lines, mem = _trainer_lines("critic", cfg.critic, cfg, layouts["critic"], critic_shape,
                                   resolve_model_path(cfg.critic.model_path))
        out += lines
        add("critic", ranks["critic"], mem, working=WORKING_KINDS)
    colocated = ranks["rollout"] == ranks["actor"]
    tp = cfg.rollout.tp_size
    engine = cfg.rollout.engine
    engine_name = getattr(engine, "_component_", "torchrlhf.generation.NativeEngine").rsplit(".", 1)[-1]
    replicas = len(ranks["rollout"]) // tp
    out.append(f"  rollout   ranks {_ranks(ranks['rollout'])}: {engine_name}, {replicas} replica(s) of TP {tp}, "
               + ("colocated with the actor (weights streamed in from training at each rollout)" if colocated
                  else "on its own ranks (weights pushed after each update"
                  + (", into a relay while generating)" if cfg.trainer.mode == "async" else ")")))
    dtype_bytes = _bytes(cfg.actor.dtype)
    memory = {"weights": shape.params * dtype_bytes / tp}
    if not colocated and cfg.actor.lora is not None:
        out.append(f"      LoRA: each sync carries the adapters only ({shape.adapter_params * dtype_bytes / 2**20:.2f} MiB "
                   f"against {shape.params * dtype_bytes / 2**20:.1f} MiB for the full weights), "
                   "merged into the base here")
    if cfg.trainer.mode == "async":
        a = cfg.async_training
        synced = shape.adapter_params if cfg.actor.lora is not None else shape.params
        memory["relay (CPU)"] = (a.max_staleness + 2) * synced * dtype_bytes / tp
        out.append(f"      async: schedule {a.schedule}, max_staleness {a.max_staleness}, relay of ≤ "
                   f"{a.max_staleness + 2} versions ({_gib(memory['relay (CPU)'])} CPU per rollout rank)")
    slots = getattr(engine, "max_batch_size", None)
    seq = getattr(engine, "max_seq_len", None)
    if slots and seq:
        memory["KV cache"] = slots * seq * shape.kv_bytes_per_token(dtype_bytes) / tp
        out.append(f"      KV cache: {slots} slots × {seq} tokens = {_gib(memory['KV cache'])} per rank")
    agent = cfg.rollout.agent
    if agent is not None and (agent.harness.fn or agent.verifiers):
        what = (f"verifiers environment {agent.verifiers['env']} (an episode per trajectory, its policy seat on an "
                if agent.verifiers else f"harness {agent.harness.fn} (an ")
        out.append(f"      agent: {what}OpenAI-compatible endpoint on {agent.harness.host}), "
                   f"≤ {cfg.rollout.max_tokens} model tokens over all calls, ≤ {agent.harness.timeout_s:g}s per "
                   f"trajectory; reward: {agent.reward}")
    elif agent is not None:
        what = ", ".join(filter(None, [f"tools {list(agent.tools)}" if agent.tools else "",
                                       f"env {agent.env.get('_component_')}" if agent.env else ""]))
        out.append(f"      agent: {what}; ≤ {agent.max_turns} model turns, ≤ {cfg.rollout.max_tokens} model tokens over "
                   f"all turns, observations ≤ {agent.max_tool_response_tokens} tokens each"
                   + (f", whole trajectory ≤ {seq} tokens (rollout.engine.max_seq_len)" if seq else "")
                   + f"; reward: {agent.reward}")
    # colocated, `generation_mode` frees the engine's weights and KV cache after generating
    add("rollout", ranks["rollout"], memory, working=("weights", "KV cache") if colocated else ())
    for role in ("reward_model", "cost_model"):
        sec = getattr(cfg, role)
        if sec is not None:
            rm_shape = model_shape(resolve_model_path(sec.model_path), value_head=True)
            out.append(f"  {role:<9} ranks {_ranks(ranks[role])}: {rm_shape.params / 1e6:.1f} M parameters")
            add(role, ranks[role], {"weights": rm_shape.params * _bytes(sec.dtype) / len(ranks[role])})
    if cfg.judge is not None:  # one engine per judge.tp_size ranks: weights and KV cache divided by TP only
        judge, engine = cfg.judge, cfg.judge.engine
        j_shape = model_shape(resolve_model_path(judge.model_path))
        tp = judge.tp_size
        memory = {"weights": j_shape.params * _bytes(judge.dtype) / tp}
        slots, seq = (getattr(engine, k, None) for k in ("max_batch_size", "max_seq_len"))
        kv = ""
        if isinstance(slots, int) and isinstance(seq, int):
            memory["KV cache"] = slots * seq * j_shape.kv_bytes_per_token(_bytes(judge.dtype)) / tp
            kv = f", KV cache {slots} slots × {seq} tokens = {_gib(memory['KV cache'])} per rank"
        sleeps = "; held only while judging (judge.sleep)" if judge.sleep else ""
        engines = f", {len(ranks['judge']) // tp} engine(s) of TP {tp}" if tp > 1 else ""
        out.append(f"  judge     ranks {_ranks(ranks['judge'])}: {j_shape.params / 1e6:.1f} M parameters{engines}{kv}; "
                   f"verdicts ≤ {judge.sampling.max_tokens} tokens, {judge.batch_size} per engine call{sleeps}")
        add("judge", ranks["judge"], memory, working=("weights", "KV cache") if judge.sleep else ())

    out += _flops_lines(cfg, layouts, shapes)
    if sync:
        out.append("memory per rank (estimate: what the rank holds throughout a step, plus the largest working set "
                   "of one role's calls: the roles run one after another, and a colocated engine's weights and KV "
                   "cache are freed after generation):")
    else:
        out.append("memory per rank (estimate; in async mode every role's memory adds up):")
    for r in range(world_size):
        items = per_rank[r]
        detail = ", ".join(f"{k} {_gib(v)}" for k, v in items.items())
        out.append(f"  rank {r}: {_rank_peak(items, phase_of[r])}  ({detail})")
    return "\n".join(out)


def _rank_peak(items: dict[str, float], phase_of: dict[str, str]) -> str:
    """"2.93 GiB, in the actor's calls (held throughout 1.00 GiB; working sets: actor 1.93, ...)": the items
    held throughout plus the largest phase's working set; the plain sum where no item has a phase."""
    working: dict[str, float] = {}
    for key, phase in phase_of.items():
        working[phase] = working.get(phase, 0.0) + items[key]
    held = sum(v for k, v in items.items() if k not in phase_of)
    if not working:
        return _gib(held)
    top = max(working, key=working.__getitem__)
    sets = ", ".join(f"{p} {working[p] / GIB:.2f}" for p in working)
    return (f"{_gib(held + working[top])}, in the {top}'s calls (held throughout {_gib(held)}; working sets: "
            f"{sets} GiB)")


__all__ = ["explain", "model_shape", "ModelShape"]
