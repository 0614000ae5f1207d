"""Typed sections of a recipe config that the controller itself consumes.

Worker sections (``actor``, ``critic``, ``reward_model``, ...) mirror the worker
constructors instead; these dataclasses cover the dataflow's own knobs. Keys mirror
the attributes one to one; a group of keys that belong together is a section of its own
(``algorithm.kl_ctrl``, ``trainer.checkpoint``), a frozen dataclass that checks itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Literal

from torchrlhf.agents.agent import AgentSpec
from torchrlhf.algorithms import FilterGroups, KLControl, Lagrangian, OverlongBuffer
from torchrlhf.config import as_section
from torchrlhf.generation.sampling import SamplingParams


@dataclass
class DistillConfig:
    """``algorithm.distill``: on-policy distillation from the ``teacher`` section's model
    (`torchrlhf.algorithms.distill`): ``A_t = task_coef * A_task_t + coef * (log pi_teacher(y_t) - log pi_student(y_t))``
    on the student's sampled tokens. ``task_coef: 0`` is pure distillation."""

    coef: float = 1.0
    task_coef: float = 1.0

    def __post_init__(self) -> None:
        if self.coef < 0 or self.task_coef < 0:
            raise ValueError(f"coef and task_coef must be >= 0, got coef={self.coef}, task_coef={self.task_coef}")


@dataclass
class AlgorithmConfig:
    """Advantage estimation, KL and algorithm-specific knobs.

    ``kl_ctrl`` (`torchrlhf.algorithms.KLControl`): the coefficient of the KL penalty folded into the reward when
    ``use_kl_in_reward`` (PPO-style; KL as a loss lives in ``actor.loss``). DAPO: ``filter_groups``
    (`torchrlhf.algorithms.FilterGroups`, dynamic sampling) and ``overlong_buffer``
    (`torchrlhf.algorithms.OverlongBuffer`, overlong reward shaping). Safe-RLHF: ``lagrangian``
    (`torchrlhf.algorithms.Lagrangian`), the cost constraint's Lagrange multiplier, used when a cost model is
    configured.
    """

    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_ctrl: KLControl = field(default_factory=KLControl)
    filter_groups: FilterGroups = field(default_factory=FilterGroups)
    overlong_buffer: OverlongBuffer = field(default_factory=OverlongBuffer)
    lagrangian: Lagrangian = field(default_factory=Lagrangian)
    # On-policy distillation from the ``teacher`` section's model (off when None).
    distill: DistillConfig | None = None

    def __post_init__(self) -> None:
        self.kl_ctrl = as_section(KLControl, self.kl_ctrl)
        self.filter_groups = as_section(FilterGroups, self.filter_groups)
        self.overlong_buffer = as_section(OverlongBuffer, self.overlong_buffer)
        self.lagrangian = as_section(Lagrangian, self.lagrangian)


@dataclass
class RolloutConfig(SamplingParams):
    """Sampling for training and validation rollouts, and the rollout role's layout.

    The sampling keys are `SamplingParams`' own fields, validated by it with the config; `sampling` and
    `val_sampling` give the typed object that travels unchanged to the engine. The engine itself is the
    ``rollout.engine`` sub-section (its ``_component_`` and constructor arguments; see `trainer.schema`).
    ``offload_optimizer``: colocated with the actor on an accelerator, the actor's optimizer state waits in
    host memory while the engine generates (its device memory goes to the KV cache), at the cost of a copy
    each way per rollout; ``false`` keeps it on the device when memory allows (verl's ``optimizer_offload``,
    OpenRLHF's ``--adam_offload``, in spirit). No effect on CPU.
    ``tp_size`` is each engine's tensor-parallel size; ``weight_sync_bucket_mb`` bounds the buckets that
    carry new weights to rollout ranks of their own. Validation samples ``val_n`` responses at
    ``val_temperature`` (0: greedy). ``agent`` (`torchrlhf.agents.AgentSpec`) makes every rollout a
    multi-turn trajectory with tools or an environment; ``max_tokens`` then counts the model's tokens over
    all turns, and the engine's ``max_seq_len`` bounds the whole trajectory.
    """

    max_tokens: int = 64
    seed: int | None = field(default=None, init=False)  # per-prompt seeds come from the trainer
    logprobs: bool = field(default=True, init=False)  # training reads the engine's log-probs
    tp_size: int = 1
    weight_sync_bucket_mb: int = 64
    offload_optimizer: bool = True
    val_temperature: float = 0.0
    val_n: int = 1
    agent: AgentSpec | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.val_temperature < 0:
            raise ValueError(f"val_temperature: must be >= 0, got {self.val_temperature}")
        if self.val_n < 1:
            raise ValueError(f"val_n: must be >= 1, got {self.val_n}")

    def sampling(self) -> SamplingParams:
        """The training rollouts' sampling parameters."""
        return SamplingParams(**{f.name: getattr(self, f.name) for f in fields(SamplingParams)})

    def val_sampling(self) -> SamplingParams:
        return replace(self.sampling(), n=self.val_n, temperature=self.val_temperature)


@dataclass
class ProfileConfig:
    """``trainer.profile``: torch.profiler traces of chosen steps (verl's ``profile_steps``).

    In each of ``steps`` (1-based, as logged) every rank of each of ``roles`` (None: every role of the run)
    records its calls of the step in the thread that computes them (`torchrlhf.runtime.profiling`) and
    writes ``<dir>/step_<N>/<role>_rank<R>.json`` (Chrome/Perfetto trace) and ``.txt`` (key-averages
    table). ``dir``: None puts them in ``<trainer.output_dir>/profile``.
    """

    steps: list[int] = field(default_factory=list)
    roles: list[str] | None = None
    dir: str | None = None

    def __post_init__(self) -> None:
        bad = [s for s in self.steps if s < 1]
        if bad:
            raise ValueError(f"steps: must be >= 1 (global steps count from 1), got {bad}")
        if self.roles is not None and len(set(self.roles)) != len(self.roles):
            raise ValueError(f"roles: listed twice in {self.roles}")


@dataclass(frozen=True)
class CheckpointConfig:
    """``trainer.checkpoint``: `torchrlhf.trainer.checkpointing.CheckpointManager`'s settings, under
    ``trainer.output_dir``.

    ``save_freq``: a checkpoint every that many steps and after the last one (0: none). ``keep_last``: only the
    newest complete checkpoints are kept (None or 0: all). ``resume``: ``auto`` (the latest complete checkpoint
    under ``trainer.output_dir``, or a newer memory snapshot, if any), ``disable``, or a checkpoint's path.
    ``snapshot_freq``: a snapshot of the training state in node-local shared memory every that many steps (0:
    none; `torchrlhf.utils.snapshot`), which a job restarted by torchrun resumes from before the disk.
    ``snapshot_dir``: where (a tmpfs; None: ``/dev/shm/torchrlhf/<hash of trainer.output_dir>``), each node
    in its own ``node<n>`` part. ``snapshot_peer``: every rank also keeps its part in the memory of a rank on
    another node, so a lost node loses no part of the snapshot (needs ranks on two nodes or more).
    """

    save_freq: int = 0
    keep_last: int | None = None
    resume: str = "auto"
    snapshot_freq: int = 0
    snapshot_dir: str | None = None
    snapshot_peer: bool = False

    def __post_init__(self) -> None:
        for key in ("save_freq", "snapshot_freq"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}: must be >= 0 (0: off), got {getattr(self, key)}")
        if self.snapshot_peer and self.snapshot_freq == 0:
            raise ValueError("snapshot_peer: copies memory snapshots to another node; set snapshot_freq > 0 too")


@dataclass
class TrainerConfig:
    """The loop: length, validation, checkpoints, logging.

    ``mode``: ``sync`` (generate, then train, every step) or ``async`` (rollout ranks of their own generate
    while the actor trains; the ``async_training`` section says how far they may run ahead).
    ``stall_timeout_s``: a worker call running longer ends the job with a report of what every rank is
    doing (method, seconds, the collective it waits in, its stack; `runtime.stall`); 0 turns it off.
    ``peak_flops``: one device's peak FLOP/s, the denominator of the ``perf/mfu/*`` metrics (`utils.flops`);
    None: each rank measures its matmul peak in each role's dtype once, at start-up.
    ``checkpoint``: when checkpoints are written, how many are kept and which one a run resumes from
    (`CheckpointConfig`).
    ``profile``: torch.profiler traces of chosen steps (`ProfileConfig`; off by default).
    """

    total_steps: int = 10
    mode: Literal["sync", "async"] = "sync"
    stall_timeout_s: float = 1800.0
    critic_warmup: int = 0
    test_freq: int = 0
    val_before_train: bool = False
    output_dir: str = "outputs/run"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    project_name: str = "torchrlhf"
    experiment_name: str = "run"
    log_val_generations: int = 4
    seed: int = 0
    peak_flops: float | None = None
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def __post_init__(self) -> None:
        self.checkpoint = as_section(CheckpointConfig, self.checkpoint)
        if self.peak_flops is not None and not self.peak_flops > 0:
            raise ValueError(f"peak_flops: must be > 0 (FLOP/s per device) or null, got {self.peak_flops}")


@dataclass
class RepackConfig:
    """``async_training.repack``: Laminar's dynamic repack of long-tail samples (stream schedule, the native
    engine; `torchrlhf.rollouts.repack`).

    ``min_active_fraction``: a rollout call hands back its unfinished samples once its decoding slots, having
    filled that fraction of the engine's ``max_batch_size``, fall below it. ``long_tail_replicas``: how many
    rollout replicas (the last ones) continue the carried samples before taking new prompts.
    """

    enable: bool = False
    min_active_fraction: float = 0.25
    long_tail_replicas: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.min_active_fraction <= 1:
            raise ValueError(f"min_active_fraction: must be in (0, 1], got {self.min_active_fraction}")
        if self.long_tail_replicas < 1:
            raise ValueError(f"long_tail_replicas: must be >= 1, got {self.long_tail_replicas}")


@dataclass
class AsyncConfig:
    """How rollouts run ahead of training when ``trainer.mode`` is ``async`` (see `torchrlhf.rollouts.background`).

    ``max_staleness``: a sample trains at most this many actor updates after the weights that generated it.
    ``schedule``: ``stream`` (Laminar-style: each rollout replica takes ``prompts_per_call`` prompts at a
    time, loading the newest weights between calls; the fastest) or ``deterministic`` (batch t is
    generated with exactly weight version t - max_staleness: bit-for-bit reproducible, resumable).
    ``stale_policy``: a stream group found too stale when the trainer takes it is ``requeue``-d (its
    prompt generated again) or ``drop``-ped.
    ``tolerate_rollout_failures``: a rollout rank whose process dies is dropped with its replica (its TP
    peers stay idle), its prompts in flight are generated again elsewhere and training goes on (logged as
    an error; ``async/lost_rollout_ranks`` counts the replica's ranks). The deterministic schedule then generates the batch again with
    the same version, but the run no longer reproduces an uninterrupted one bit for bit. Otherwise, or for
    any other rank, the job ends.
    ``partial_rollout``: the engine also loads newer weights between two decode steps, inside a trajectory,
    and records the version per token (stream schedule, ``rollout.tp_size`` 1, the native engine).
    ``repack``: move long-tail samples to dedicated replicas (`RepackConfig`).
    """

    max_staleness: int = 1
    schedule: Literal["stream", "deterministic"] = "stream"
    stale_policy: Literal["requeue", "drop"] = "requeue"
    prompts_per_call: int = 1
    tolerate_rollout_failures: bool = True
    partial_rollout: bool = False
    repack: RepackConfig = field(default_factory=RepackConfig)

    def __post_init__(self) -> None:
        self.repack = as_section(RepackConfig, self.repack)


@dataclass
class DataConfig:
    """Prompt files and batch sizes. ``train_batch_size`` counts prompts; each gets ``rollout.n`` responses."""

    train_files: list[str]
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    max_prompt_length: int = 512
    apply_chat_template: bool = True
    system_prompt: str | None = None
    train_batch_size: int = 8
    val_batch_size: int = 64
    shuffle: bool = True
    seed: int = 0
    max_samples: int | None = None
    val_max_samples: int | None = None


@dataclass
class RefConfig:
    """The frozen reference policy (built only when a KL term needs it); unset keys follow the actor."""

    model_path: str | None = None
    dtype: str | None = None
    log_prob_micro_batch_size_per_device: int | None = None
    cpu_offload: bool = False


@dataclass
class TeacherConfig(RefConfig):
    """The frozen teacher of on-policy distillation (``algorithm.distill``): a second model scoring the
    student's samples, placed with the actor like the reference; unset keys follow the actor. It must
    share the actor's tokenizer (the teacher scores the student's token ids)."""

    model_path: str


@dataclass
class PlacementConfig:
    """Ranks of each role. ``None``: the actor (with the reference and the rollout) on every rank, other roles
    beside it.

    Roles on the same ranks are colocated (one process per rank holds them all, the hybrid engine);
    roles on disjoint ranks run side by side (split placement).
    """

    actor: list[int] | None = None
    rollout: list[int] | None = None  # None: colocated with the actor (hybrid engine)
    critic: list[int] | None = None
    teacher: list[int] | None = None  # None: with the actor; else ranks no other role uses
    reward_model: list[int] | None = None
    cost_model: list[int] | None = None
    judge: list[int] | None = None
