"""The planner's entry point: rank the mappings of a config on a cluster, print the top ones, write the best.

    result = plan(cfg, world_size=8, nodes=1, hardware=load_hardware("h100"))
    print(format_plan(result))
    path = write_plan(result, "recipes/configs/X.yaml", overrides, "outputs/X/plan_w8.yaml")

The written config is the user's file with their command-line overrides and the plan's overrides applied, and
validates as a run would (the planner never changes the user's file). With no mapping that fits, the result says
so and names the smallest world size (in whole nodes) that has one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from omegaconf import OmegaConf

from torchrlhf.config import ConfigError, load_config
from torchrlhf.config._parse import apply_overrides
from torchrlhf.plan.hardware import GIB, HardwareProfile
from torchrlhf.plan.memory import traced_ahead
from torchrlhf.plan.problem import plan_input
from torchrlhf.plan.search import Candidate, Planner, PlanResult
from torchrlhf.trainer.schema import RecipeConfig

MAX_WORLD = 16384  # where the search for the smallest fitting cluster stops
VERIFY_ROWS = 8  # candidates checked by direct traces before the plan gives up on the rest


def plan(cfg: RecipeConfig, world_size: int, *, hardware: HardwareProfile, nodes: int = 1,
         prompt_len: float | None = None, response_len: float | None = None) -> PlanResult:
    """Every mapping of ``cfg`` on ``world_size`` ranks over ``nodes`` nodes that fits ``hardware``'s memory,
    fastest first by simulated step time."""
    if nodes < 1 or world_size % nodes:
        raise ConfigError(f"--nodes {nodes} must divide --world-size {world_size} (ranks are spread evenly over nodes)")
    data = plan_input(cfg, prompt_len=prompt_len, response_len=response_len)
    planner = Planner(data, hardware)
    w = data.problem.workload
    workload = (f"{w.prompts} prompts × n {w.n} per step; prompts of {w.prompt_len:.0f} tokens ({data.prompt_len_source}),"
                f" responses of {w.response_len:.0f} (the longest {w.longest_response})")
    with traced_ahead(planner.dense_traces()):  # a second core traces what the search will ask for next
        candidates, considered = planner.candidates(world_size, nodes)
        candidates = _verified_first(planner, candidates, world_size // nodes)
        result = PlanResult(world_size, nodes, hardware, candidates, considered, workload=workload)
        if not candidates:
            node_size, world = world_size // nodes, world_size * 2
            while world <= MAX_WORLD and not planner.candidates(world, world // node_size if nodes > 1 else 1)[0]:
                world *= 2
            result.smallest_fit = world if world <= MAX_WORLD else None
    return result


def _verified_first(planner: Planner, candidates: list[Candidate], node_size: int) -> list[Candidate]:
    """The candidates with the fastest one that fits by `Planner.verify` first: rows are checked in order until a
    checked one is at least as fast as the next unchecked estimate (a check only shrinks micro-batches, so never
    speeds a row up), at most `VERIFY_ROWS` of them; none checked, none kept."""
    checked, rest = [], list(candidates)
    while rest and len(checked) < VERIFY_ROWS:
        c = planner.verify(rest.pop(0), node_size)
        if c is not None:
            checked.append(c)
        checked.sort(key=lambda c: c.estimate.seconds)
        if checked and (not rest or checked[0].estimate.seconds <= rest[0].estimate.seconds):
            break
    return checked[:1] + sorted(checked[1:] + rest, key=lambda c: c.estimate.seconds) if checked else []


def _ranks(first: int, count: int) -> str:
    return f"{first}" if count == 1 else f"{first}-{first + count - 1}"


def describe(c: Candidate) -> str:
    """"actor 0-3 tp2 µ8/16 | rollout 4-7 tp1×4 | critic ...": each role's ranks, TP and micro-batches."""
    parts = []
    for role, r in c.mapping.roles.items():
        if role == "rollout":
            colocated = c.mapping.colocated("rollout", "actor")
            parts.append(f"rollout {'with actor' if colocated else _ranks(r.first, r.ranks)} tp{r.tp}×{r.ranks // r.tp}")
        elif role in ("actor", "critic"):
            ep = f" ep{r.ep}" if r.ep > 1 else ""
            parts.append(f"{role} {_ranks(r.first, r.ranks)} tp{r.tp}{ep} µ{r.micro}/{r.log_prob_micro}")
        else:
            parts.append(f"{role} {_ranks(r.first, r.ranks)}")
    return " | ".join(parts)


def format_plan(result: PlanResult, top: int = 5) -> str:
    hw = result.hardware
    head = (f"torchrlhf plan: world size {result.world_size} on {result.nodes} node(s), hardware {hw.name} "
            f"({hw.memory_gib:g} GiB per device); {result.considered} mappings simulated, "
            f"{len(result.candidates)} fit\nworkload: {result.workload}")
    if not result.candidates:
        fit = (f"the smallest cluster with a plan has {result.smallest_fit} ranks" if result.smallest_fit
               else f"none up to {MAX_WORLD} ranks fits either")
        return f"{head}\nno plan: no mapping fits in {hw.memory_gib:g} GiB per device; {fit}"
    lines = [head, "rank  step s  schedule     placement      stages (s)  peak GiB  bottleneck"]
    for i, c in enumerate(result.candidates[:top], 1):
        m = c.mapping
        schedule = "sync" if m.mode == "sync" else f"async k={m.max_staleness}"
        stages = ", ".join(f"{k} {v:.3g}" for k, v in c.estimate.by_stage().items())
        lines.append(f"{i:>4}  {c.estimate.seconds:6.3g}  {schedule:<11}  {c.placement:<13}  "
                     f"{c.peak_bytes / GIB:8.2f}  {c.estimate.bottleneck}")
        lines.append(f"      {describe(c)}")
        lines.append(f"      {stages}")
    return "\n".join(lines)


def write_plan(result: PlanResult, config_path: str | Path, cli_overrides: Sequence[str], out: str | Path) -> Path:
    """The user's config with their overrides and the best candidate's, written to ``out`` (a new file)."""
    best = result.best
    if best is None:
        raise ConfigError("no plan to write")
    cfg = load_config(config_path, cli_overrides, add_missing=True)
    apply_overrides(cfg, best.overrides, add_missing=True)
    out = Path(out)
    if out.resolve() == Path(config_path).resolve():
        raise ConfigError(f"the plan would overwrite the user's config {config_path}; give another path")
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# written by torchrlhf's planner from {config_path} for world size {result.world_size} on "
              f"{result.nodes} node(s), hardware {result.hardware.name}: simulated step {best.estimate.seconds:.3g} s\n"
              f"# overrides: {' '.join(best.overrides)}\n")
    out.write_text(header + OmegaConf.to_yaml(cfg))
    return out


__all__ = ["describe", "format_plan", "plan", "write_plan"]
