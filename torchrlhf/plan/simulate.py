"""The time of one RL step for a mapping (where each role runs, its layout, micro-batches, schedule), from FLOPs,
bytes and a `HardwareProfile`: no model is built and nothing runs.

The step is the dataflow the controller drives (`RLTrainer.train_step`): generate, then the forward passes (old
log-probs, reference, teacher, values, reward model), then the critic's and the actor's updates, then the weight
sync. Each stage is timed on its role's ranks:

- a compute-bound pass (training, forward, prefill): ``calls · call_s + FLOPs per rank / (peak · efficiency)``, plus
  its collectives: FSDP2's parameter gathers (and, training, the gradients' reduce-scatter), TP's all-reduces
  (two per layer per forward, four with backward) and expert parallelism's all-to-alls (the same count, of each
  token's ``top_k`` copies), each ``latency + bytes / bandwidth`` on the link it crosses;
- decode: ``steps · (step_s + bound / efficiency + slots · vocabulary · sample_ns_per_logit)``, where a step reads
  the engine's weights (of a mixture-of-experts model's experts, those its slots' tokens were routed to:
  `decode_weights`) and the KV cache of its slots, its roofline ``bound`` is the larger of bytes / bandwidth and
  FLOPs / peak on a GPU and their sum on a CPU (`hardware.decode_bound_s`), and a synchronous generation decodes as
  many steps as its longest response;
- the weight sync: colocated, every rank's engine takes back its weights and KV cache after gathering the other
  ranks' FSDP2 shards; split, the actor gathers each parameter whole and broadcasts them to the rollout ranks.

Stages add up in a synchronous step (the controller calls the roles one after another; roles on ranks of their own
wait meanwhile). An asynchronous step overlaps generation (on the rollout ranks) with training (on the others): its
time is the slower side. On a CPU whose ranks outnumber its compute units, ranks computing at the same time share
them (``compute_units_per_node``). In an asynchronous step generation starts as the trainer takes its batch: the
training stages compute beside it, in order, until it is done, and the rest of the step alone (and generation
beside the training, then alone, when it is the longer side).

What it leaves out is listed in ``docs/planning.md``: the variance of response lengths beyond the longest, the
reward function's time (in ``step_overhead_s``), host↔device offload copies, and memory fragmentation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torchrlhf.plan.hardware import HardwareProfile, Link, sampling_s
from torchrlhf.plan.hardware import share as hardware_share
from torchrlhf.trainer.explain import ModelShape
from torchrlhf.utils.flops import causal_keys

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ADAMW_BYTES = 28  # float32 parameter, gradient, two moments read; parameter and moments written


@dataclass(frozen=True)
class Workload:
    """One step's data: ``prompts`` prompts × ``n`` samples of ``prompt_len`` (mean) + ``response_len`` tokens;
    ``longest_response`` sets a synchronous generation's decode steps."""

    prompts: int
    n: int
    prompt_len: float
    response_len: float
    longest_response: int

    @property
    def samples(self) -> int:
        return self.prompts * self.n


@dataclass(frozen=True)
class Role:
    """A role's place in a mapping: its ranks' count, where they start (nodes are ``node_size`` consecutive ranks),
    its tensor-parallel size, the micro-batch sizes its passes cut a rank's samples into, and (a mixture-of-experts
    model) its expert-parallel size."""

    ranks: int
    first: int = 0
    tp: int = 1
    micro: int = 1  # training micro-batch (samples per rank)
    log_prob_micro: int = 1  # forward-only passes
    ep: int = 1  # experts split over ``ep`` adjacent data-parallel ranks (`runtime.ParallelDims`)

    @property
    def dp(self) -> int:
        return self.ranks // self.tp


@dataclass(frozen=True)
class Stage:
    name: str
    role: str
    seconds: float
    ranks: tuple[int, int]  # [first, first + count)


@dataclass
class StepEstimate:
    stages: list[Stage]
    seconds: float
    bottleneck: str
    generation_s: float = 0.0
    training_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def by_stage(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for s in self.stages:
            out[s.name] = out.get(s.name, 0.0) + s.seconds
        return out


# ------------------------------------------------------------------ collectives
def link_between(first: int, count: int, node_size: int, hw: HardwareProfile, inside: Link | None = None) -> Link:
    """The slowest link inside ranks [first, first + count): across nodes when they span more than one; inside a
    node, ``inside`` where given (a step's FSDP2 or TP traffic as calibrated), else the node's link."""
    if first // node_size == (first + count - 1) // node_size:
        return inside or hw.intra_node
    return hw.inter_node


def collective_s(link: Link, nbytes: float, calls: int = 1) -> float:
    """``calls`` collectives moving ``nbytes`` per rank in all over ``link``."""
    return calls * link.latency_us * 1e-6 + nbytes / (link.bandwidth_gbps * 1e9)


def share(busy_on_node: int, hw: HardwareProfile) -> float:
    """How much slower a rank computes when ``busy_on_node`` ranks of its node compute at once (`hardware.share`)."""
    return hardware_share(busy_on_node, hw.compute_units_per_node, hw.concurrent_slowdown)


# ------------------------------------------------------------------ stages
def pass_s(model: ModelShape, role: Role, hw: HardwareProfile, *, dtype: str, samples: int, prompt_len: float,
           response_len: float, train: bool, node_size: int, busy: int, passes: int = 1,
           shared_prompts: int = 0, optimizer_steps: int = 0, prefix_passes: int = 1) -> float:
    """A role's forward (``train``: forward + backward) over ``samples`` samples, ``passes`` times (PPO epochs ×
    mini-batches cut the same samples further but not the FLOPs), each data-parallel rank its shard in micro-batches
    of ``role.micro`` (train) or ``role.log_prob_micro``; ``shared_prompts``: prompts forwarded once for their
    samples (shared-prefix training, in ``prefix_passes`` passes of their own: one per mini-batch), else each sample
    carries its prompt. ``optimizer_steps`` AdamW steps each
    read and write a rank's shard of the trained parameters and their states: `ADAMW_BYTES` per parameter at the
    memory bandwidth. A data-parallel group's passes compute ``hw.fsdp_slowdown`` times slower, beside FSDP2's
    traffic."""
    per_rank = math.ceil(samples / role.dp)
    micro = role.micro if train else role.log_prob_micro
    calls = passes * math.ceil(per_rank / micro)
    if shared_prompts:  # and a prefix pass per mini-batch: a call of its own, with its own FSDP2 gathers
        calls += prefix_passes
        p_tokens = shared_prompts * prompt_len
        tokens = p_tokens + samples * response_len
        keys = shared_prompts * causal_keys(int(prompt_len)) + samples * causal_keys(int(response_len), int(prompt_len))
    else:
        tokens = samples * (prompt_len + response_len)
        keys = samples * causal_keys(int(prompt_len + response_len))
    scored = samples * response_len
    flops = (model.flops.train if train else model.flops.forward)(tokens, keys, scored) * passes
    cost = hw.train if train else hw.forward
    compute = (calls * cost.call_s + flops / role.ranks / (hw.peak_flops(dtype) * cost.efficiency)) * share(busy, hw)
    if role.dp > 1:  # FSDP2's prefetched gathers run beside the passes' compute
        compute *= hw.fsdp_slowdown
    trained = model.adapter_params or model.params
    compute += optimizer_steps * trained / role.ranks * ADAMW_BYTES / (hw.memory_bandwidth_gbps * 1e9) * share(busy, hw)
    b = DTYPE_BYTES[dtype]
    comm = 0.0
    if role.dp > 1:  # FSDP2: gather the parameters per forward (and again for backward), reduce-scatter float32 grads
        link = link_between(role.first, role.ranks, node_size, hw, inside=hw.fsdp)
        # with EP, a rank gathers only its own experts, from the dp / ep ranks that shard the same ones
        group = role.dp // role.ep
        shard = ((model.params - model.expert_params) / role.tp * (role.dp - 1) / role.dp
                 + model.expert_params / role.ep * (group - 1) / group)
        per_call = shard * (2 * b + 4) if train else shard * b
        comm += calls * collective_s(link, per_call, calls=model.layers * (3 if train else 1))
    if role.ep > 1:  # tokens to their experts' ranks and back: two all-to-alls per sparse layer forward, two backward
        link = link_between(role.first, role.ep, node_size, hw)
        per_layer = 2 * (2 if train else 1)
        moved = tokens * passes / role.dp * model.top_k * model.hidden * b * (role.ep - 1) / role.ep
        comm += collective_s(link, moved * per_layer * model.layers, calls=calls * per_layer * model.layers)
    if role.tp > 1:  # two all-reduces of a micro-batch's activations per layer forward, two more backward
        link = link_between(role.first, role.tp, node_size, hw, inside=hw.tp)
        per_layer = 2 * (2 if train else 1)
        moved = tokens * passes / role.dp * model.hidden * b * 2 * (role.tp - 1) / role.tp
        comm += collective_s(link, moved * per_layer * model.layers, calls=calls * per_layer * model.layers)
    return compute + comm


def decode_weights(model: ModelShape, slots: int) -> float:
    """The weights a decode step over ``slots`` tokens reads: all of a dense model's; of a mixture-of-experts
    model's experts, those its tokens were routed to. Each token picks ``top_k`` of ``experts`` per layer, so with
    uniform routing an expert is left out by all of them with probability ``(1 - top_k / experts) ** slots``."""
    if not model.experts:
        return float(model.params)
    hit = 1.0 - (1.0 - model.top_k / model.experts) ** slots
    return model.params - model.expert_params * (1.0 - hit)


def generate_s(model: ModelShape, rollout: Role, hw: HardwareProfile, *, dtype: str, prompts: int, n: int,
               prompt_len: float, decode_steps: float, response_len: float, max_slots: int, node_size: int,
               busy: int, colocated: bool = False) -> float:
    """Every replica (``rollout.tp`` ranks) generating its share of ``prompts`` × ``n`` samples in waves of at most
    ``max_slots``: a prefill of the wave's prompts, then ``decode_steps`` decode steps over its slots (``colocated``:
    on the training model's weights, `HardwareProfile.decode_cost`). A replica's ranks split the blocks and each
    runs the whole LM head, as the native engine does."""
    replicas = rollout.ranks // rollout.tp
    samples = math.ceil(prompts * n / replicas)
    slots = min(samples, max_slots)
    waves = math.ceil(samples / slots)
    b = DTYPE_BYTES[dtype]
    slow = share(busy, hw)
    f = model.flops
    head = f.hidden * f.head_out  # the LM head: whole on every TP rank of the engine (`split_blocks_over_tp`)

    def per_rank(tokens: int, keys: int, scored: int) -> float:  # the blocks split over TP, the head not
        return f.forward(tokens, keys, 0) / rollout.tp + f.forward(0, 0, scored)

    sample = sampling_s(slots, f.head_out, hw.sample_ns_per_logit)  # a token for every slot
    prefill_tokens = slots / n * prompt_len
    prefill = (hw.forward.call_s + per_rank(int(prefill_tokens), int(slots / n * causal_keys(int(prompt_len))),
                                            max(1, int(slots / n)))
               / (hw.peak_flops(dtype) * hw.forward.efficiency) + sample) * slow
    context = prompt_len + response_len / 2  # mean keys a decode step reads per slot
    read = ((decode_weights(model, slots) - head) * b + slots * context * model.kv_bytes_per_token(b)) / rollout.tp \
        + head * b
    flops = per_rank(slots, int(slots * context), slots)
    cost = hw.decode_cost(colocated)
    # a CPU rank sharing its compute unit runs every part of the step, host work included, at its share
    step = (cost.step_s + hw.decode_bound_s(read, flops, dtype) / cost.efficiency + sample) * slow
    if rollout.tp > 1:
        link = link_between(rollout.first, rollout.tp, node_size, hw, inside=hw.tp_engine or hw.tp)
        step += collective_s(link, slots * model.hidden * b * 2, calls=2 * model.layers)
    return waves * (prefill + decode_steps * step)


def weight_sync_s(model: ModelShape, actor: Role, rollout: Role, hw: HardwareProfile, *, dtype: str,
                  node_size: int, kv_tokens: int = 0) -> float:
    """New weights into the engines. Colocated: each rank's engine takes back its TP shard of the weights and its KV
    cache of ``kv_tokens`` tokens (slots × sequence length), which it released to training, at
    ``engine_resume_gbps``, and with FSDP2 over dp > 1 ranks gathers the other ranks' shards first, one collective
    per parameter tensor (`hybrid.iter_generation_weights`) on FSDP2's link. Split: the actor's ranks gather each
    parameter whole, FSDP2's float32 master weights (`hybrid.broadcast.send_weights`), and its first rank broadcasts
    the weights (in ``dtype``) to the rollout ranks."""
    b = DTYPE_BYTES[dtype]
    if rollout.first == actor.first and rollout.ranks == actor.ranks:
        filled = (model.params * b + kv_tokens * model.kv_bytes_per_token(b)) / rollout.tp
        seconds = filled / ((hw.engine_resume_gbps or hw.memory_bandwidth_gbps) * 1e9)
        if actor.dp > 1:
            link = link_between(actor.first, actor.ranks, node_size, hw, inside=hw.fsdp)
            seconds += collective_s(link, model.params * b / rollout.tp * (actor.dp - 1) / actor.dp,
                                    calls=max(1, model.tensors))
        return seconds
    gathers = 0.0
    if actor.ranks > 1:
        inside = link_between(actor.first, actor.ranks, node_size, hw, inside=hw.fsdp)
        gathers = collective_s(inside, model.params * 4 * (actor.ranks - 1) / actor.ranks, calls=max(1, model.tensors))
    span_first = min(actor.first, rollout.first)
    span = max(actor.first + actor.ranks, rollout.first + rollout.ranks) - span_first
    link = link_between(span_first, span, node_size, hw)
    return gathers + collective_s(link, model.params * b, calls=max(1, model.layers))


__all__ = ["DTYPE_BYTES", "Role", "Stage", "StepEstimate", "Workload", "collective_s", "decode_weights", "generate_s",
           "link_between", "pass_s", "share", "weight_sync_s"]


# ------------------------------------------------------------------ one step
@dataclass(frozen=True)
class Problem:
    """What a config asks of a step, as numbers: the models (by role), their compute dtypes, the workload, and the
    dataflow's choices (`torchrlhf.plan.problem.problem_from_config` reads them from a recipe config)."""

    models: dict[str, ModelShape]  # actor, and each of critic / reward_model / cost_model / teacher present
    dtypes: dict[str, str]  # role -> compute dtype name ("rollout": the engine's)
    workload: Workload
    mini_batches: dict[str, int]  # trained role -> optimizer steps per PPO epoch
    epochs: dict[str, int]
    old_log_prob: bool  # the actor's extra forward
    reference: bool  # a separate reference forward on the actor's ranks
    shared_prefix: dict[str, bool]
    max_slots: int  # the engine's KV slots (samples decoded together)
    max_seq_len: int  # prompt + response a KV slot holds


@dataclass(frozen=True)
class Mapping:
    """A candidate: each role's `Role`, the schedule, and (async) the staleness bound and the stream's prompts per
    call. Roles absent from ``roles`` sit with the actor (the reference always does)."""

    roles: dict[str, Role]
    mode: str = "sync"  # or "async" (the stream schedule)
    max_staleness: int = 0
    prompts_per_call: int = 1

    def colocated(self, a: str, b: str) -> bool:
        ra, rb = self.roles[a], self.roles[b]
        return ra.first == rb.first and ra.ranks == rb.ranks


def step_estimate(problem: Problem, mapping: Mapping, hw: HardwareProfile, *, node_size: int) -> StepEstimate:
    """The simulated time of one step of ``mapping`` (see the module docstring)."""
    # ranks computing at once on a node: a stage's own (its role's ranks, at most a node's), and in an asynchronous
    # step, while the other side runs, all of them
    node_of = lambda r: min(r.ranks, node_size)  # noqa: E731
    if mapping.mode != "async":
        stages = _stages(problem, mapping, hw, node_size=node_size, busy=node_of)
        generation = sum(s.seconds for s in stages if s.name == "generate")
        training = sum(s.seconds for s in stages if s.name != "generate")
        return StepEstimate(stages, generation + training + hw.step_overhead_s,
                            max(stages, key=lambda s: s.seconds).name, generation, training)
    world = max(r.first + r.ranks for r in mapping.roles.values())
    alone = _stages(problem, mapping, hw, node_size=node_size, busy=node_of)
    beside = _stages(problem, mapping, hw, node_size=node_size, busy=lambda r: min(world, node_size))
    # the stream takes the next batch's prompts as the trainer takes a batch: generation runs beside the training
    # stages from the step's start, in order, and each side runs alone once the other is done
    (gen_alone, gen_beside), trained = (alone[0], beside[0]), []  # `_stages` puts the one "generate" first
    left = gen_beside.seconds
    for a, b in zip(alone[1:], beside[1:]):
        done = min(1.0, left / b.seconds) if b.seconds else 1.0  # of the stage's work, beside generation
        trained.append(dataclasses.replace(a, seconds=done * b.seconds + (1 - done) * a.seconds))
        left -= done * b.seconds
    training = sum(s.seconds for s in trained)
    done = min(1.0, training / gen_beside.seconds) if gen_beside.seconds else 1.0  # of generation's work, beside
    generation = done * gen_beside.seconds + (1 - done) * gen_alone.seconds
    stages = [dataclasses.replace(gen_beside, seconds=generation), *trained]
    bottleneck = "generate" if generation >= training else max(
        (s for s in stages if s.name != "generate"), key=lambda s: s.seconds).name
    return StepEstimate(stages, max(generation, training) + hw.step_overhead_s, bottleneck, generation, training)


def _stages(problem: Problem, mapping: Mapping, hw: HardwareProfile, *, node_size: int,
            busy: Callable[[Role], int]) -> list[Stage]:
    """Every stage of a step of ``mapping``, each computing beside ``busy(role)`` ranks of its node."""
    w, roles, models, dtypes = problem.workload, mapping.roles, problem.models, problem.dtypes
    actor, rollout = roles["actor"], roles["rollout"]
    asynchronous = mapping.mode == "async"
    stages: list[Stage] = []

    def add(name: str, role: str, seconds: float) -> None:
        r = roles[role]
        stages.append(Stage(name, role, seconds, (r.first, r.first + r.ranks)))

    if asynchronous:  # the stream: each replica takes prompts_per_call prompts at a time, all samples to the end
        replicas = rollout.ranks // rollout.tp
        calls = math.ceil(w.prompts / (replicas * mapping.prompts_per_call))
        one_call = generate_s(models["actor"], rollout, hw, dtype=dtypes["rollout"], prompts=mapping.prompts_per_call * replicas,
                              n=w.n, prompt_len=w.prompt_len, decode_steps=w.longest_response,
                              response_len=w.response_len, max_slots=problem.max_slots, node_size=node_size,
                              busy=busy(rollout))
        add("generate", "rollout", calls * one_call)
    else:
        add("generate", "rollout", generate_s(
            models["actor"], rollout, hw, dtype=dtypes["rollout"], prompts=w.prompts, n=w.n, prompt_len=w.prompt_len,
            decode_steps=w.longest_response, response_len=w.response_len, max_slots=problem.max_slots,
            node_size=node_size, busy=busy(rollout), colocated=mapping.colocated("rollout", "actor")))

    def forward(name: str, role: str, model: str, shared: bool = False) -> None:
        r = roles[role]
        add(name, role, pass_s(models[model], r, hw, dtype=dtypes[role], samples=w.samples, prompt_len=w.prompt_len,
                               response_len=w.response_len, train=False, node_size=node_size, busy=busy(r),
                               shared_prompts=w.prompts if shared else 0))

    for scorer in ("reward_model", "cost_model"):
        if scorer in models:
            forward(scorer, scorer, scorer)
    if problem.old_log_prob:
        forward("old_log_prob", "actor", "actor", problem.shared_prefix["actor"])
    if problem.reference:
        forward("ref", "actor", "actor", problem.shared_prefix["actor"])
    if "teacher" in models:
        forward("teacher", "teacher", "teacher")
    for role in ("critic", "actor"):
        if role not in models:
            continue
        if role == "critic":
            forward("values", "critic", "critic", problem.shared_prefix["critic"])
        r = roles[role]
        add(f"update_{role}", role, pass_s(
            models[role], r, hw, dtype=dtypes[role], samples=w.samples, prompt_len=w.prompt_len,
            response_len=w.response_len, train=True, node_size=node_size, busy=busy(r), passes=problem.epochs[role],
            optimizer_steps=problem.epochs[role] * problem.mini_batches[role],
            prefix_passes=problem.epochs[role] * problem.mini_batches[role],
            shared_prompts=w.prompts * problem.epochs[role] if problem.shared_prefix[role] else 0))
    add("weight_sync", "actor", weight_sync_s(models["actor"], actor, rollout, hw, dtype=dtypes["rollout"],
                                              node_size=node_size, kv_tokens=problem.max_slots * problem.max_seq_len))
    return stages


__all__ += ["Mapping", "Problem", "step_estimate"]
