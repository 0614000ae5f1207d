"""The auto device mapping (HybridFlow §6, Algorithm 1): enumerate placements, give each its ranks, pick each role's
layout and micro-batches, keep what fits memory, rank by the simulated step time.

    python recipes/ppo.py --config X.yaml --plan --world-size 8 [--nodes 1] [--hardware h100|FILE]

1. **Placements.** The roles fall into three sets: the actor (with its reference, and a teacher), the rollout, and
   the others (critic, reward and cost models). A placement colocates some sets and gives the rest ranks of their
   own: all colocated; the rollout apart; the others apart (HybridFlow's "split"); all three apart.
2. **Ranks.** Every split of the world into the placement's pools (whole nodes when there are several).
3. **Layouts.** Per role, every TP size that divides its pool, stays inside a node and divides the model's heads
   (a colocated rollout follows the actor's); per rollout on ranks of its own, every engine TP size. A family
   without a training TP plan (`models.parallelize.TP_SUPPORTED_MODEL_TYPES`: mixture-of-experts models) trains at
   TP 1, and a mixture-of-experts actor takes every expert-parallel size that divides its data-parallel ranks and
   its experts; its engines, colocated too, every TP size (`models.expert_parallel.split_experts_over_tp`).
4. **Micro-batches.** For each layout, the largest micro-batch (dividing a rank's samples) whose traced memory fits
   (`torchrlhf.plan.memory`), with every role's held state and the engine's weights and KV cache beside it.
5. **Schedule.** Sync, and with the rollout apart, async (the stream) with ``max_staleness`` 1, 2 and 4.

Each candidate is timed by `torchrlhf.plan.simulate.step_estimate`; the fastest is written as a config.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

from torchrlhf.plan.hardware import HardwareProfile
from torchrlhf.plan.memory import dense_traces, micro_batch_memory, shallow_depths
from torchrlhf.plan.problem import PlanInput, TracedRole
from torchrlhf.plan.simulate import Mapping, Role, StepEstimate, step_estimate
from torchrlhf.generation.model import SUPPORTED_MODEL_TYPES
from torchrlhf.models.parallelize import TP_SUPPORTED_MODEL_TYPES, model_layout
from torchrlhf.trainer.explain import ModelShape
from torchrlhf.trainer.memory import WORKING_KINDS, as_held

STALENESS = (1, 2, 4)
PLACEMENTS = {  # name -> pools, each a tuple of role sets; the actor's pool first (rank 0 is the controller)
    "colocated": (("actor", "rollout", "others"),),
    "rollout apart": (("actor", "others"), ("rollout",)),
    "others apart": (("actor", "rollout"), ("others",)),
    "all apart": (("actor",), ("rollout",), ("others",)),
}
OTHERS = ("critic", "reward_model", "cost_model")


@dataclass
class Candidate:
    placement: str
    mapping: Mapping
    estimate: StepEstimate
    peak_bytes: float  # the fullest rank's
    overrides: list[str] = field(default_factory=list)


@dataclass
class PlanResult:
    world_size: int
    nodes: int
    hardware: HardwareProfile
    candidates: list[Candidate]  # fastest first
    considered: int  # mappings simulated
    smallest_fit: int | None = None  # with no candidate: the smallest world size that has one
    workload: str = ""  # what was planned for, in words

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _compositions(total: int, parts: int, unit: int) -> Iterator[tuple[int, ...]]:
    """Ordered splits of ``total`` ranks into ``parts`` positive multiples of ``unit``."""
    whole = total // unit
    for cuts in itertools.combinations(range(1, whole), parts - 1):
        bounds = (0, *cuts, whole)
        yield tuple((bounds[i + 1] - bounds[i]) * unit for i in range(parts))


def _tp_options(pool: int, node_size: int, heads: tuple[int, int], shape: ModelShape, engine: bool = False
                ) -> list[int]:
    """TP sizes of a role on ``pool`` ranks: dividing them and the heads, inside a node. Training has a TP plan for
    the dense families only; the native engine (``engine``) splits a mixture-of-experts model's experts over its TP
    ranks too, so their count must divide by it."""
    families = SUPPORTED_MODEL_TYPES if engine else TP_SUPPORTED_MODEL_TYPES
    if shape.model_type not in families:
        return [1]
    return [t for t in _divisors(pool) if t <= node_size and heads[0] % t == 0 and heads[1] % t == 0
            and (not shape.experts or shape.experts % t == 0)]


def _ep_options(dp: int, node_size: int, shape: ModelShape) -> list[int]:
    """Expert-parallel sizes of a mixture-of-experts model on ``dp`` data-parallel ranks: dividing them and its
    experts (`runtime.ParallelDims`, `trainer.schema`), inside a node (its all-to-alls cross it every layer)."""
    if not shape.experts:
        return [1]
    return [e for e in _divisors(dp) if e <= node_size and shape.experts % e == 0]


def _micro_options(per_rank: int) -> list[int]:
    """Micro-batch sizes that split a rank's samples evenly (as the config check requires): smallest first."""
    return _divisors(per_rank)


class Planner:
    """Enumerates and times the mappings of one `PlanInput` on a cluster (see the module docstring)."""

    def __init__(self, data: PlanInput, hw: HardwareProfile) -> None:
        self.data, self.hw = data, hw
        self.p = data.problem
        self.roles_present = [r for r in OTHERS if r in self.p.models]

    # -------------------------------------------------------------- memory
    def _trace_kw(self, traced: TracedRole) -> dict:
        """What every trace of ``traced`` is taken with (`plan.memory.micro_batch_memory`, `dense_traces`)."""
        return dict(prompt_len=self.data.max_prompt_len, response_len=self.p.workload.longest_response,
                    dtype=traced.dtype, lora=traced.lora, activation_checkpointing=traced.activation_checkpointing,
                    optim=traced.optim, use_kl_loss=traced.use_kl_loss, device_type=self.hw.device_type)

    def dense_traces(self) -> list[tuple]:
        """Every dense trace the search may take (`plan.memory.dense_traces`), fewest rows first: each traced role's
        passes at up to a whole mini-batch (an update) or step (a no-grad pass) of samples per rank."""
        w, out = self.p.workload, []
        for role, traced in self.data.traced.items():
            shape = self.p.models["actor" if role == "ref" else role]
            no_grad = {"train": "forward", "value": "value_forward"}.get(traced.kind)
            passes = [(traced.kind, w.samples)] if no_grad is None else [
                (traced.kind, w.prompts // self.p.mini_batches.get(role, 1) * w.n), (no_grad, w.samples)]
            for kind, rows in passes:
                out += dense_traces(traced.model_path, (kind,), rows, **self._trace_kw(traced),
                                    depths=shallow_depths(traced.model_path, shape.layers))
        return sorted(dict.fromkeys(out), key=lambda t: t[-1])

    def _state(self, role: str, traced: TracedRole, dp: int, tp: int, micro: int,
               shared: tuple[int, int] | None = None, no_grad: bool = False, floor: bool = False,
               exact: bool = False) -> tuple[float, float]:
        """(held throughout the step, working set of its calls: its gradients, activations and temporaries) per rank,
        in bytes. ``shared`` = (prompts, n):
        with shared prefixes, the distinct prompts a rank's prompts' pass holds through its suffix micro-batches
        and the samples of each (`plan.memory.micro_batch_memory` counts the schedule). ``no_grad``: the working
        set of a trained role's no-grad pass (old log-probs, values) instead of its update's. ``floor``: a lower
        bound in one trace; ``exact``: the shared-prefix schedule traced at this part (`micro_batch_memory`'s)."""
        shape = self.p.models["actor" if role == "ref" else role]
        depths = shallow_depths(traced.model_path, shape.layers)
        kind = {"train": "forward", "value": "value_forward"}.get(traced.kind, traced.kind) if no_grad else traced.kind
        by_kind = micro_batch_memory(traced.model_path, kind=kind, micro=micro, depths=depths, layers=shape.layers,
                                     shared=shared, floor=floor, exact=exact, **self._trace_kw(traced))
        layout = model_layout(dp * tp, traced.dtype, trainable=traced.kind != "forward", cpu_offload=traced.cpu_offload,
                              lora=traced.lora is not None)
        held = as_held(by_kind, dtype=traced.dtype, shards=dp * tp, tp=tp, layout=layout, lora=traced.lora is not None)
        if traced.cpu_offload:  # FSDP2's CPU offload keeps parameters, gradients and optimizer states on the host
            held = {k: v for k, v in held.items() if k in WORKING_KINDS and k != "gradients"}
        return (sum(v for k, v in held.items() if k not in WORKING_KINDS),
                sum(v for k, v in held.items() if k in WORKING_KINDS))

    def _engine(self, tp: int) -> float:
        """The engine's weights and KV cache per rank (its configured slots × sequence length)."""
        b = self.data.engine_dtype_bytes
        shape = self.p.models["actor"]
        return (shape.params * b + self.p.max_slots * self.p.max_seq_len * shape.kv_bytes_per_token(b)) / tp

    def _fit_micro(self, role: str, dp: int, tp: int, per_rank: int, held: float, working: list[float],
                   asynchronous: bool, no_grad: bool = False, at_most: int | None = None, exact: bool = False
                   ) -> tuple[int, float] | None:
        """The largest micro-batch of ``role`` whose working set fits beside ``held`` and the pool's other working
        sets (their max in sync, their sum in async), and that working set; None if not even 1 fits. Memory grows
        with the micro-batch, so a bisection of the sizes finds it in a few traces, and a size whose lower bound
        (`micro_batch_memory`'s ``floor``) does not fit costs one. ``no_grad``: its no-grad passes' micro-batch.
        ``at_most``: no larger than that, and tried first; ``exact``: shared-prefix schedules traced at their part
        (`verify`)."""
        traced = self.data.traced[role]
        shared = self.p.shared_prefix.get("actor" if role == "ref" else role, False)
        prompts = max(1, math.ceil(per_rank / self.p.workload.n))
        part = (prompts, max(1, per_rank // prompts)) if shared else None

        def fits(micro: int) -> tuple[bool, float]:
            work = 0.0
            for floor in (False,) if exact else (True, False):
                _, work = self._state(role, traced, dp, tp, micro, part, no_grad, floor, exact)
                peak = held + (work + sum(working) if asynchronous else max([work, *working]))
                if peak > self.hw.memory_bytes:
                    return False, work
            return True, work

        options = [m for m in _micro_options(max(per_rank, 1)) if at_most is None or m <= at_most]
        if at_most is not None:  # a check of the search's size, which most often fits: one trace then
            ok, work = fits(options[-1])
            if ok:
                return options[-1], work
            options = options[:-1]
            if not options:
                return None
        ok, work = fits(options[0])
        if not ok:
            return None
        best, lo, hi = (options[0], work), 1, len(options) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            ok, work = fits(options[mid])
            if ok:
                best, lo = (options[mid], work), mid + 1
            else:
                hi = mid - 1
        return best

    # -------------------------------------------------------------- search
    def candidates(self, world: int, nodes: int) -> tuple[list[Candidate], int]:
        node_size = world // nodes
        out, considered = [], 0
        for name, pools in PLACEMENTS.items():
            pools = tuple(tuple(s for s in pool if s != "others" or self.roles_present) for pool in pools)
            if any(not pool for pool in pools):
                continue
            unit = node_size if nodes > 1 else 1
            for sizes in _compositions(world, len(pools), unit):
                for cand in self._place(name, pools, sizes, node_size):
                    considered += 1
                    if cand is not None:
                        out.append(cand)
        out.sort(key=lambda c: (round(c.estimate.seconds, 9), c.mapping.max_staleness, c.peak_bytes))
        return _dedupe(out), considered

    def _place(self, name: str, pools: tuple, sizes: tuple[int, ...], node_size: int) -> Iterator[Candidate | None]:
        firsts = [sum(sizes[:i]) for i in range(len(sizes))]
        pool_of = {s: i for i, pool in enumerate(pools) for s in pool}
        a_pool = pool_of["actor"]
        heads, models = self.data.heads, self.p.models
        actor_layouts = [(tp, ep) for tp in _tp_options(sizes[a_pool], node_size, heads["actor"], models["actor"])
                         for ep in _ep_options(sizes[a_pool] // tp, node_size, models["actor"])]
        split_rollout = pool_of["rollout"] != a_pool
        # apart, every engine TP size; colocated, the actor's, except that a mixture-of-experts actor (TP 1) may
        # generate at any engine TP size, so that its engines hold a share of the experts each
        rollout_tps = (_tp_options(sizes[pool_of["rollout"]], node_size, heads["actor"], models["actor"], engine=True)
                       if split_rollout or models["actor"].experts else [None])
        other_roles = self.roles_present
        critic_tps = (_tp_options(sizes[pool_of["others"]], node_size, heads["critic"], models["critic"])
                      if "critic" in other_roles else [None])
        schedules = [("sync", 0)] + ([("async", k) for k in STALENESS] if split_rollout else [])
        for (a_tp, a_ep), r_tp, c_tp, (mode, k) in itertools.product(actor_layouts, rollout_tps, critic_tps,
                                                                      schedules):
            roles = {"actor": Role(sizes[a_pool], firsts[a_pool], a_tp, ep=a_ep)}
            r_pool = pool_of["rollout"]
            roles["rollout"] = (Role(sizes[r_pool], firsts[r_pool], r_tp) if split_rollout
                                else Role(sizes[a_pool], firsts[a_pool], r_tp or a_tp))
            for role in other_roles:
                o = pool_of["others"]
                roles[role] = Role(sizes[o], firsts[o], c_tp if role == "critic" else 1)
            if "teacher" in self.p.models:
                roles["teacher"] = Role(sizes[a_pool], firsts[a_pool], a_tp)
            yield self._candidate(name, roles, pools, pool_of, mode, k, node_size)

    def _candidate(self, name: str, roles: dict[str, Role], pools: tuple, pool_of: dict, mode: str, k: int,
                   node_size: int, fixed: dict[str, int] | None = None) -> Candidate | None:
        """The mapping's candidate with the largest micro-batches that fit, or None. ``fixed``: no larger than
        these (role, and ``role/log_prob`` for its no-grad passes), with shared-prefix schedules traced at their
        part."""
        exact = fixed is not None
        fixed = fixed or {}
        asynchronous = mode == "async"
        w = self.p.workload
        # the roles on each pool's ranks, traced ones with their layouts
        members: dict[int, list[str]] = {i: [] for i in range(len(pools))}
        for role in roles:
            if role == "rollout":
                continue
            members[pool_of.get(role, pool_of["actor"]) if role != "teacher" else pool_of["actor"]].append(role)
        if "ref" in self.data.traced:
            members[pool_of["actor"]].append("ref")
        peak, micro = 0.0, {}
        for i, pool_roles in members.items():
            held, working = 0.0, []
            engine = self._engine(roles["rollout"].tp)
            if pool_of["rollout"] == i:
                if pool_of["rollout"] == pool_of["actor"]:
                    working.append(engine)  # released after generation
                else:
                    held += engine
            layouts = {}
            for role in pool_roles:
                r = roles["actor" if role == "ref" else role]
                layouts[role] = r
                state, _ = self._state(role, self.data.traced[role], r.dp, r.tp, 1)
                held += state
            fitted = {}
            for role in pool_roles:  # trained roles first take the largest micro-batch that fits, then forwards
                r = layouts[role]
                train = self.data.traced[role].kind != "forward"
                mini = w.prompts // self.p.mini_batches.get(role, 1) * w.n
                if train and mini % r.dp:
                    return None  # a mini-batch's samples must split over the data-parallel ranks
                per_rank = mini // r.dp if train else math.ceil(w.samples / r.dp)
                fit = self._fit_micro(role, r.dp, r.tp, per_rank, held, working, asynchronous,
                                      at_most=fixed.get(role), exact=exact)
                if fit is None:
                    return None
                fitted[role] = fit
                working.append(fit[1])
                if train:  # its no-grad passes (old log-probs, values), beside the pool's other working sets
                    lp = self._fit_micro(role, r.dp, r.tp, math.ceil(w.samples / r.dp), held, working[:-1],
                                         asynchronous, no_grad=True, at_most=fixed.get(role + "/log_prob"),
                                         exact=exact)
                    if lp is None and exact:
                        return None
                    fitted[role + "/log_prob"] = lp or fit
            pool_peak = held + (sum(working) if asynchronous else max(working, default=0.0))
            peak = max(peak, pool_peak)
            for role, (m, _) in fitted.items():
                micro[role] = m
        for role in list(roles):
            if role in micro:
                lp = micro.get(role + "/log_prob", micro[role])
                roles[role] = dataclasses.replace(roles[role], micro=micro[role], log_prob_micro=lp)
        if "ref" in micro:  # the reference's forwards run in the actor's log-prob micro-batches
            a = roles["actor"]
            roles["actor"] = dataclasses.replace(a, log_prob_micro=min(a.log_prob_micro, micro["ref"]))
        mapping = Mapping(roles, mode, k, max(1, w.prompts // max(1, roles["rollout"].ranks // roles["rollout"].tp)))
        estimate = step_estimate(self.p, mapping, self.hw, node_size=node_size)
        world = max(r.first + r.ranks for r in roles.values())
        seq = self.data.max_prompt_len + w.longest_response
        return Candidate(name, mapping, estimate, peak, overrides(mapping, world, self.data.dynamic_batching, seq,
                                                                  experts=bool(self.p.models["actor"].experts)))


    def verify(self, cand: Candidate, node_size: int) -> Candidate | None:
        """``cand`` checked with its shared-prefix schedules traced at their very parts (the search extends traces
        of two and four prompts): the largest micro-batches up to its own that fit by those traces, timed again, or
        None when not even one row fits. Without shared prefixes the search's estimate is already an upper bound,
        and ``cand`` is kept."""
        if not any(self.p.shared_prefix.values()):
            return cand
        pools = tuple(tuple(s for s in pool if s != "others" or self.roles_present)
                      for pool in PLACEMENTS[cand.placement])
        pool_of = {s: i for i, pool in enumerate(pools) for s in pool}
        roles = cand.mapping.roles
        fixed = {}
        for role, r in roles.items():
            if role in self.data.traced:
                fixed[role], fixed[role + "/log_prob"] = r.micro, r.log_prob_micro
        if "ref" in self.data.traced:  # the reference runs in the actor's log-prob micro-batches
            fixed["ref"] = roles["actor"].log_prob_micro
        return self._candidate(cand.placement, dict(roles), pools, pool_of, cand.mapping.mode,
                               cand.mapping.max_staleness, node_size, fixed)


def _dedupe(cands: list[Candidate]) -> list[Candidate]:
    """One row per mapping that differs in more than the staleness bound (the simulator models mean times, so a
    larger bound never looks faster; the smallest is kept)."""
    seen, out = set(), []
    for c in cands:
        key = (c.placement, tuple(sorted((k, v) for k, v in c.mapping.roles.items())), c.mapping.mode)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def overrides(mapping: Mapping, world: int, dynamic: dict[str, bool] | None = None, seq: int = 0, *,
              experts: bool = False) -> list[str]:
    """The config overrides that make a run use ``mapping``. A role that cuts micro-batches by tokens
    (``dynamic[role]``) keeps doing so, with a budget of the chosen micro-batch's rows of ``seq`` tokens.
    ``experts``: the actor is a mixture-of-experts model, and its expert-parallel size is set too."""
    dynamic = dynamic or {}

    def batching(role: str, r: Role) -> list[str]:
        out = [f"{role}.batching.ppo_micro_batch_size_per_device={r.micro}",
               f"{role}.batching.log_prob_micro_batch_size_per_device={r.log_prob_micro}"]
        if dynamic.get(role):
            out.append(f"{role}.batching.max_tokens_per_micro_batch={r.micro * seq}")
        return out

    roles = mapping.roles

    def ranks(r: Role) -> str:
        return "[" + ",".join(str(i) for i in range(r.first, r.first + r.ranks)) + "]"

    a, ro = roles["actor"], roles["rollout"]
    out = [f"placement.actor={'null' if a.ranks == world else ranks(a)}",
           f"placement.rollout={'null' if mapping.colocated('rollout', 'actor') else ranks(ro)}",
           f"actor.tp_size={a.tp}", *([f"actor.ep_size={a.ep}"] if experts else []), f"rollout.tp_size={ro.tp}",
           *batching("actor", a)]
    for role in ("critic", "reward_model", "cost_model"):
        if role in roles:
            r = roles[role]
            out.append(f"placement.{role}={'null' if mapping.colocated(role, 'actor') else ranks(r)}")
    if "critic" in roles:
        c = roles["critic"]
        out += [f"critic.tp_size={c.tp}", *batching("critic", c)]
    out.append(f"trainer.mode={mapping.mode}")
    if mapping.mode == "async":
        out += ["async_training.schedule=stream", f"async_training.max_staleness={mapping.max_staleness}",
                f"async_training.prompts_per_call={mapping.prompts_per_call}"]
    return out


__all__ = ["Candidate", "PLACEMENTS", "PlanResult", "Planner", "overrides"]
