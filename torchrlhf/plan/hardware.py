"""A hardware profile: the few rates the step simulator (`torchrlhf.plan.simulate`) turns FLOPs and bytes into seconds.

A profile is a YAML (or JSON) file; every key names its unit, and a value is a plain number in that unit. Two
ship with the library (`SHIPPED`, chosen by name with ``--hardware NAME``), each figure labelled with where it
came from in the file's ``source``; ``--calibrate`` measures one on the user's machine (`torchrlhf.plan.calibrate`).

Each kind of work has a time model of two terms, a fixed cost per call and a rate:

- a training or forward pass over ``F`` FLOPs in ``m`` micro-batches: ``m · call_s + F / (peak · efficiency)``;
- a decode step reading ``B`` bytes and doing ``F`` FLOPs over ``b`` slots of a ``V``-token vocabulary:
  ``step_s + bound / efficiency + b · V · sample_ns_per_logit``, where the roofline ``bound`` is
  ``max(B / bandwidth, F / peak)`` on a GPU and ``B / bandwidth + F / peak`` on a CPU (`decode_bound_s`);
- a collective over ``n`` ranks moving ``B`` bytes: ``latency + B / bandwidth`` on the link it crosses.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from yaml import YAMLError

from torchrlhf.config import ConfigError, validate

PROFILES_DIR = Path(__file__).with_name("profiles")
GIB = 1 << 30


@dataclass(frozen=True)
class Link:
    """A link between ranks: ``bandwidth_gbps`` GB/s (10^9 bytes) per rank as a collective sees it, and
    ``latency_us`` µs per collective call."""

    bandwidth_gbps: float
    latency_us: float


@dataclass(frozen=True)
class PassCost:
    """A compute-bound pass: the fraction of the matmul peak it reaches, and a fixed cost per micro-batch call."""

    efficiency: float
    call_s: float


@dataclass(frozen=True)
class DecodeCost:
    """A decode step: the fraction of its roofline bound (`decode_bound_s`) that it reaches, and a fixed cost per
    step (host work, kernel launches)."""

    efficiency: float
    step_s: float


@dataclass(frozen=True)
class HardwareProfile:
    """One device kind and its links.

    ``memory_gib``: memory per device the planner may fill (a GPU's HBM; on a CPU, the host's memory divided by
    the ranks it will run). ``compute_units_per_node``: on a CPU, how many ranks can compute at once (cores ÷
    threads per rank); ranks beyond it share them. None for GPUs (one rank per device). ``concurrent_slowdown``: on a
    CPU, how much slower each rank computes when all the units compute at once than when it computes alone (SMT
    siblings, a shared memory bus); 1 on GPUs. ``matmul_tflops``: the
    peak per device by dtype name (``float32``, ``bfloat16``). ``step_overhead_s``: the controller's own time per
    RL step (calls, batch moves, the reward function). ``fsdp``: FSDP2's gathers and reduce-scatters inside a node as a
    training step sees them (measured in one by `torchrlhf.plan.calibrate.probe_fsdp`; on a CPU they share the cores
    with the compute); None: the node's link. ``tp``: tensor parallelism's all-reduces inside a node as a step sees
    them (`torchrlhf.plan.calibrate.probe_tp`: on a CPU, DTensor's dispatch and the wait for the other rank count as
    latency); None: the node's link. ``tp_engine``: the same inside the native engine's decode step, whose TP runs on
    plain tensors (`torchrlhf.plan.calibrate.probe_tp_engine`); None: as ``tp``. ``decode_shared``: decode on the
    training model's own weights, as a
    colocated engine does (on a CPU without the projections an engine that owns its weights prepacks); None: as
    ``decode``. ``engine_resume_gbps``: the rate at which a colocated engine takes back its weights and KV cache at
    each rollout, after releasing them to training (`hybrid.generation_mode`; measured by
    `torchrlhf.plan.calibrate.probe_engine_resume`: on a CPU the fresh pages fault in at a fraction of the copy
    bandwidth); None: ``memory_bandwidth_gbps``. ``sample_ns_per_logit``: the sampler's time per vocabulary logit
    of each token it samples (softmax, the inverse CDF: `torchrlhf.plan.calibrate.probe_sampling`), a decode step's
    cost per slot that no roofline counts (on a CPU a quarter to a half of a tiny model's step at 32 slots); None: not
    measured, 0. ``fsdp_slowdown``: how much slower a rank of an FSDP2 group computes its passes than one alone,
    beyond the traffic and the node's contention (``concurrent_slowdown``): FSDP2 prefetches the next gather while a
    block computes, and on a CPU gloo's threads take that time from the cores
    (`torchrlhf.plan.calibrate.probe_fsdp`: SmolLM2's shape, 1 thread per rank, its extra time grew 3.2 s to 4.8 s
    from 1 to 16 rows where one alone took 1.0 s and 7.2 s); 1: none."""

    name: str
    source: str
    memory_gib: float
    matmul_tflops: dict[str, float]
    memory_bandwidth_gbps: float
    train: PassCost
    forward: PassCost
    decode: DecodeCost
    intra_node: Link
    inter_node: Link
    fsdp: Link | None = None
    tp: Link | None = None
    tp_engine: Link | None = None
    decode_shared: DecodeCost | None = None
    engine_resume_gbps: float | None = None
    sample_ns_per_logit: float | None = None
    step_overhead_s: float = 0.0
    compute_units_per_node: int | None = None
    concurrent_slowdown: float = 1.0
    fsdp_slowdown: float = 1.0

    @property
    def device_type(self) -> str:
        """"cpu" for a CPU profile (it counts its compute units), else "cuda"."""
        return "cpu" if self.compute_units_per_node is not None else "cuda"

    def __post_init__(self) -> None:
        problems = []
        for key in ("memory_gib", "memory_bandwidth_gbps"):
            if not getattr(self, key) > 0:
                problems.append(f"{key} must be > 0, got {getattr(self, key)}")
        for dtype, value in self.matmul_tflops.items():
            if not value > 0:
                problems.append(f"matmul_tflops.{dtype} must be > 0, got {value}")
        for key in ("train", "forward", "decode"):
            eff = getattr(self, key).efficiency
            if not 0 < eff <= 1:
                problems.append(f"{key}.efficiency is a fraction of the peak in (0, 1], got {eff}")
        for key in ("intra_node", "inter_node"):
            if not getattr(self, key).bandwidth_gbps > 0:
                problems.append(f"{key}.bandwidth_gbps must be > 0, got {getattr(self, key).bandwidth_gbps}")
        if self.sample_ns_per_logit is not None and not self.sample_ns_per_logit >= 0:
            problems.append(f"sample_ns_per_logit must be >= 0 or null, got {self.sample_ns_per_logit}")
        for key in ("concurrent_slowdown", "fsdp_slowdown"):
            if not getattr(self, key) >= 1:
                problems.append(f"{key} is a factor >= 1, got {getattr(self, key)}")
        if self.compute_units_per_node is not None and self.compute_units_per_node < 1:
            problems.append(f"compute_units_per_node must be >= 1 or null, got {self.compute_units_per_node}")
        if problems:
            raise ConfigError(f"hardware profile {self.name!r}:\n" + "\n".join(f"  - {p}" for p in problems))

    def decode_cost(self, colocated: bool) -> DecodeCost:
        return self.decode_shared if colocated and self.decode_shared is not None else self.decode

    def decode_bound_s(self, nbytes: float, flops: float, dtype: str) -> float:
        return decode_bound_s(nbytes, flops, self.memory_bandwidth_gbps * 1e9, self.peak_flops(dtype),
                              self.device_type)

    def peak_flops(self, dtype: str) -> float:
        """FLOP/s per device in ``dtype`` (a torch dtype name)."""
        if dtype not in self.matmul_tflops:
            raise ConfigError(f"hardware profile {self.name!r} has no matmul_tflops.{dtype} (it has "
                              f"{sorted(self.matmul_tflops)}): calibrate in that dtype or add the figure")
        return self.matmul_tflops[dtype] * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def decode_bound_s(nbytes: float, flops: float, bandwidth: float, peak: float, device_type: str) -> float:
    """The roofline bound of a decode step reading ``nbytes`` at ``bandwidth`` B/s and doing ``flops`` at ``peak``
    FLOP/s. A GPU streams the weights while it multiplies (each kernel is bound by the larger); a CPU core runs a
    step's small kernels one after another without hiding the loads behind the arithmetic, so the two add up
    (SmolLM2's shape on one core, 1 to 32 slots: the step grew 96 to 190 ms as its FLOPs did, where its bytes moved
    54 to 61 ms)."""
    if device_type == "cpu":
        return nbytes / bandwidth + flops / peak
    return max(nbytes / bandwidth, flops / peak)


def sampling_s(slots: int, vocab: int, ns_per_logit: float | None) -> float:
    """The sampler's time to draw a token for each of ``slots`` rows over a ``vocab``-token vocabulary at
    ``ns_per_logit`` (a profile's ``sample_ns_per_logit``; None: not measured, 0)."""
    return slots * vocab * (ns_per_logit or 0.0) * 1e-9


def share(busy_on_node: int, units: int | None, concurrent_slowdown: float) -> float:
    """How much slower a rank computes when ``busy_on_node`` ranks of its node compute at once; 1 on a GPU (``units``
    None). On a CPU, ranks beyond the ``units`` compute units share them, and units computing together slow each
    other down (``concurrent_slowdown`` when all do, in proportion below)."""
    if units is None or busy_on_node <= 1:
        return 1.0
    together = min(busy_on_node, units)
    contention = 1.0 + (concurrent_slowdown - 1.0) * ((together - 1) / (units - 1) if units > 1 else 0.0)
    return max(1.0, busy_on_node / units) * contention


SHIPPED = {p.stem: p for p in sorted(PROFILES_DIR.glob("*.yaml"))}
_UNIT_IN_VALUE = re.compile(r"^\s*[-+0-9.eE]+\s*[A-Za-z/%]+\s*$")


def load_hardware(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name (`SHIPPED`) or a profile file; ConfigError naming the key for a missing key, a
    value given with a unit ("80 GB": the key says the unit), or a wrong type."""
    path = SHIPPED.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise ConfigError(f"--hardware {name_or_path!r}: no such file, and not a shipped profile "
                          f"({', '.join(SHIPPED)}); `recipes/ppo.py --calibrate` writes one for this machine")
    try:
        raw = json.loads(path.read_text()) if path.suffix == ".json" else OmegaConf.to_container(OmegaConf.load(path))
    except (ValueError, YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"{path}: not a YAML/JSON hardware profile ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a hardware profile is a mapping of keys, got {type(raw).__name__}")
    units = [f"  - {key}: {value!r} carries a unit; give a plain number in the unit the key names"
             for key, value in _leaves(raw) if isinstance(value, str) and _UNIT_IN_VALUE.match(value)]
    if units:
        raise ConfigError(f"{path}: hardware profile values are plain numbers:\n" + "\n".join(units))
    try:
        return validate(raw, HardwareProfile, key="hardware")
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from e


def save_hardware(profile: HardwareProfile, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(profile.to_dict()), path)
    return path


def _leaves(d: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        out += _leaves(v, key + ".") if isinstance(v, dict) else [(key, v)]
    return out


__all__ = ["DecodeCost", "HardwareProfile", "Link", "PassCost", "SHIPPED", "decode_bound_s", "load_hardware",
           "sampling_s", "save_hardware", "share"]
