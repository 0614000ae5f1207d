"""The rollout role: a `RolloutEngine` serving generation, colocated with the actor or on its own ranks.

Colocated (``actor_group`` names the actor's group on the same ranks): the hybrid engine. The engine is
built on the first rollout and released between rollouts; each `generate` streams the actor's current
training shards into it (`hybrid.generate_with_current_weights`), so rollouts always use the newest
weights and nothing is synchronised between rollouts. Generation TP groups follow the HybridFlow
layout of the actor's mesh (`hybrid.generation_mesh`).

Split (``actor_group`` None): the engine keeps its weights and KV cache; after each actor update the
controller runs `ActorWorker.send_weights` and `RolloutWorker.receive_weights` together, which move the
new weights by bucketed broadcast from the actor's first rank (`hybrid.broadcast`). TP groups are
adjacent rollout ranks.

Asynchronous training (split placement): `receive_weights` with ``to_relay`` stores each new version in
a `WeightRelay` while the engine generates, and each `generate` first loads the ``version`` it is asked
for (chosen by the controller so the ranks of a TP group agree) at that
trajectory boundary. With ``partial`` (TP 1) the engine also loads each newer version
the relay receives between two decode steps, inside the trajectory, and records the version per token.

A LoRA actor (``lora``) on ranks of its own sends its adapter factors only; an `AdapterMerger` in front of
the engine (and of the relay) merges them into the frozen base. Colocated, the merged weights stream in
from the actor's model (`hybrid.generation_mode`).

Every generated sample carries ``weight_version``: the number of actor updates behind the weights that
produced it.
"""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path
from typing import Any

import torch

from torchrlhf import hybrid
from torchrlhf.agents import AgentSession, AgentSpec, agent_columns, build_agent
from torchrlhf.agents.harness import HarnessRunner
from torchrlhf.config import get_component
from torchrlhf.data import Batch
from torchrlhf.generation import SamplingParams
from torchrlhf.generation.base import assemble_trajectories, concat_generations, prompt_seeds, sample_sessions
from torchrlhf.generation.sampling import sample_seed
from torchrlhf.hybrid.adapters import AdapterMerger
from torchrlhf.hybrid.broadcast import Manifest, receive_weights
from torchrlhf.hybrid.relay import WeightRelay
from torchrlhf.models import build_meta_causal_lm, load_tokenizer
from torchrlhf.models.lora import LoRAConfig
from torchrlhf.runtime.registry import local_worker, process_group
from torchrlhf.runtime.worker import Dispatch, Worker, register
from torchrlhf.utils import flops
from torchrlhf.workers.base import resolve_dtype

ENGINE_ARGS_SET_BY_ROLE = ("model_or_path", "model_path", "tokenizer", "device", "dtype", "tp_mesh")


class RolloutWorker(Worker):
    """Generation behind one engine interface. Arguments mirror the ``rollout`` config section.

    Args:
        model_path: HF model directory the engine starts from (the actor's).
        engine: the ``rollout.engine`` section: ``_component_`` (a `RolloutEngine` class, default
            `torchrlhf.generation.NativeEngine`) and that class's own keyword arguments.
        tp_size: tensor-parallel size of each engine (ranks of one TP group generate together).
        dtype: the engine's weights and KV cache (the actor's ``dtype``).
        actor_group: name of the colocated actor's group (hybrid engine); None when on its own ranks.
        lora: the actor's ``lora`` section: on ranks of its own, the weight syncs carry adapter factors,
            merged here into the base (``model_path``).
        agent: the ``rollout.agent`` section as the controller validated it (an `torchrlhf.agents.AgentSpec`,
            sent as itself and loaded once here; a mapping is validated first): every sample becomes a
            multi-turn trajectory with tools or an environment, driven by the engine's own loop.
        max_tokens: the model tokens of a trajectory over all its turns (``rollout.max_tokens``; agents).
        offload_optimizer: colocated on an accelerator, move the actor's optimizer state to host memory
            while generating (`hybrid.generation_mode`'s ``offload``).
    """

    def __init__(
        self,
        model_path: str,
        *,
        engine: dict[str, Any] | None = None,
        tp_size: int = 1,
        dtype: str = "float32",
        actor_group: str | None = None,
        lora: LoRAConfig | dict | None = None,
        agent: AgentSpec | dict[str, Any] | None = None,
        max_tokens: int = 64,
        offload_optimizer: bool = True,
    ) -> None:
        super().__init__(tp=tp_size if actor_group is None else 1)  # colocated: a prompt shard per rank
        self.lora = LoRAConfig.of(lora)
        spec = dict(engine or {})
        self.engine_cls = get_component(spec.pop("_component_", "torchrlhf.generation.NativeEngine"))
        self.engine_kwargs = spec
        self.model_path = model_path
        self.tp_size = tp_size
        self.dtype = resolve_dtype(dtype)
        self.actor_group = actor_group
        self.engine = None
        self.tokenizer = None
        self.agent_spec, self.max_tokens = agent, max_tokens
        self.offload_optimizer = offload_optimizer
        self.agent = None  # built with the engine (it needs the tokenizer and the engine's sequence length)
        self.harness: HarnessRunner | None = None  # rollout.agent.harness: its OpenAI-compatible endpoint
        self.weight_version = 0
        self.relay: WeightRelay | None = None  # asynchronous training only
        self._joining: list[Batch] | None = None  # repack: carried samples for the running call, while open
        self._join_lock = threading.Lock()
        self._flops_of: flops.TransformerFlops | None = None
        self.weights_in: Any = None  # what receives synced weights: the engine, or its AdapterMerger
        # split: TP groups are adjacent ranks of this group (the controller's layout); colocated: `_build_engine`
        self.tp_mesh = self.build_meshes()[1] if self.parallel_dims.tp > 1 else None
        if actor_group is None:
            self.engine = self._build_engine()
            self.weights_in = self.engine if self.lora is None else \
                AdapterMerger(self.engine, model_path, self.lora.scaling)

    @property
    def actor(self):
        return local_worker(self.actor_group)

    def _build_engine(self):
        tp_mesh = self.tp_mesh
        if self.actor_group is not None and self.tp_size > 1:
            train_mesh = hybrid.training_mesh(self.actor.model)
            if train_mesh is None:
                raise ValueError(f"rollout.tp_size={self.tp_size} needs torch.distributed (run under torchrun)")
            tp_mesh = hybrid.generation_mesh(train_mesh, self.tp_size)["tp"]
        has_tokenizer = (Path(self.model_path) / "tokenizer_config.json").is_file()
        self.tokenizer = load_tokenizer(self.model_path) if has_tokenizer else None  # stop strings need one
        engine = self.engine_cls(self.model_path, tokenizer=self.tokenizer, device=self.device,
                                 dtype=self.dtype, tp_mesh=tp_mesh, **self.engine_kwargs)
        if self.actor_group is not None:
            engine.release()  # colocated: the weights arrive from training at each rollout
        if self.agent_spec is not None and self.agent is None:
            if self.tokenizer is None:
                raise ValueError(f"rollout.agent renders chats with the model's tokenizer; {self.model_path} has none")
            self.agent = build_agent(self.agent_spec, self.tokenizer, max_tokens=self.max_tokens,
                                     max_trajectory_tokens=engine.max_seq_len)
            if self.agent.harness is not None:
                self.harness = HarnessRunner(self.agent, self.agent.harness)
        return engine

    @staticmethod
    def _rows(prompts: Batch) -> list[dict[str, Any]]:
        """Agents: each prompt's data row as read from the data file (the dataset keeps it in ``row``)."""
        columns = prompts.non_tensors
        return columns.get("row") or [{k: v[i] for k, v in columns.items()} for i in range(len(prompts))]

    def _sessions(self, prompts: Batch, n: int) -> list[Any] | None:
        """Agents: one session per sample (prompt i's n samples adjacent), each from its data row (as read
        from the data file) and the chat the dataset rendered from it."""
        if self.agent is None or self.harness is not None:
            return None
        messages = prompts.non_tensors["messages"]
        return [AgentSession(self.agent, row, messages[i]) for i, row in enumerate(self._rows(prompts)) for _ in range(n)]

    def _run_harness(self, prompts: Batch, sampling: SamplingParams, generate: Any) -> Batch:
        """A harness per sample, its endpoint calls sampled as agent sessions of ``generate`` (the engine's
        generate, `HarnessRunner`); the trajectories in `assemble_trajectories`' columns."""
        tok = self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        seeds = prompt_seeds(prompts, sampling, self.tp_mesh)
        messages = prompts.non_tensors["messages"]  # the harness gets the prompt as the chat the dataset rendered
        rows = [{**row, "prompt": messages[i]} for i, row in enumerate(self._rows(prompts)) for _ in range(sampling.n)]
        sample_seeds = [sample_seed(seeds[k // sampling.n], k % sampling.n) for k in range(len(rows))]
        trajectories, logps = self.harness.run(rows, sample_seeds, functools.partial(sample_sessions, generate, sampling))
        table = torch.zeros(len(rows), max([1, *map(len, logps)]), dtype=torch.float32)
        for k, values in enumerate(logps):
            table[k, : len(values)] = torch.tensor(values, dtype=torch.float32)
        out = assemble_trajectories(prompts, sampling, trajectories, table, pad_id)
        for key, values in agent_columns(trajectories).items():
            out[key] = values
        return out

    # ------------------------------------------------------------------ generation
    @register(dispatch=Dispatch.DP_COMPUTE, collect=concat_generations)  # agent trajectories vary in width
    def generate(self, prompts: Batch, sampling: SamplingParams, *, version: int | None = None,
                 partial: bool = False, release_below: float | None = None, joinable: bool = False) -> Batch:
        """``sampling.n`` responses per prompt with weight ``version`` (default: the weights at hand).

        Returns the engine's columns (``responses``, ``input_ids``, ``response_mask``,
        ``rollout_log_probs``, ...) plus ``weight_version``, ``n`` rows per prompt, the other prompt
        columns repeated. Colocated, the actor's current weights are ``version``. On ranks of their own
        (asynchronous training), the engine first loads ``version`` from the relay at this trajectory
        boundary (the controller chooses it, so the ranks of a TP group agree); with ``partial`` (TP 1) it
        also loads each newer version the relay receives between two decode steps, records the version
        per token; the samples keep the version asked for (their oldest tokens' at most).
        The call's MFU (colocated: streaming the weights in included) is ``meta["perf/mfu/rollout"]``.

        Repack (split placement, `torchrlhf.rollouts.repack`): ``release_below`` hands the unfinished samples
        back when few slots still decode; prompts with the carried columns continue such samples with the
        ``version`` they started with, which may be older than the engine's (the relay keeps it). With
        ``joinable`` such a call also takes the carried samples `join` hands it while it runs.
        """
        if self.engine is None:
            self.engine = self._build_engine()
        sessions = self._sessions(prompts, sampling.n)
        extra = {} if sessions is None else {"sessions": sessions}
        start = time.perf_counter()
        if self.actor_group is not None:
            actor = self.actor
            if self.offload_optimizer and actor.device.type != "cpu":
                actor.finish_snapshot()  # its optimizer state is about to leave the accelerator
            harness = None if self.harness is None else functools.partial(self._run_harness,
                                                                          generate=self.engine.generate)
            out = hybrid.generate_with_current_weights(actor.model, self.engine, prompts, sampling,
                                                       optimizer=actor.optimizer, offload=self.offload_optimizer,
                                                       generate=harness, **extra)
            version = version or 0
        else:  # split: the ranks of a TP group got the same shard (its first rank answers)
            if version is not None:
                repacking = release_below is not None or "carried_tokens" in prompts  # may go back a version
                self._load_from_relay(version, keep_newer=partial, keep_older=repacking)
            else:
                version = self.weight_version
            if partial:
                extra["between_steps"] = self._load_newest
            if release_below is not None:
                extra["release_below"] = release_below
            if joinable:
                with self._join_lock:
                    self._joining = []
                extra["more_carried"] = self._joined
            if self.harness is not None:
                out = self._run_harness(prompts, sampling, lambda b, p, **kw: self.engine.generate(b, p, **extra, **kw))
            else:
                try:
                    out = self.engine.generate(prompts, sampling, **extra)
                finally:
                    with self._join_lock:
                        self._joining = None
        out["weight_version"] = torch.full((len(out),), version, dtype=torch.long)
        if sessions is not None:
            trajectories = [s.result() for s in sessions]
            for key, values in agent_columns(trajectories).items():
                out[key] = values
            out["final_text"] = [t.final_text for t in trajectories]  # what the reward function grades
        out.meta["perf/mfu/rollout"] = self._mfu(sampling.n, out, time.perf_counter() - start)
        return out

    @register(dispatch=Dispatch.DP_COMPUTE)
    def join(self, rows: Batch) -> bool:
        """Repack: carried samples (the carried columns, `torchrlhf.generation.base.CARRIED_COLUMNS`) join the
        ``joinable`` generate call running now; False when none runs or it has ended (they did not join)."""
        with self._join_lock:
            if self._joining is None:
                return False
            self._joining.append(rows)
            return True

    def _joined(self, final: bool) -> Batch | None:
        """The engine's ``more_carried``: what `join` received since it last asked; asked with ``final`` and
        nothing there, the call ends and takes no more."""
        with self._join_lock:
            rows = self._joining
            if not rows:
                if final:
                    self._joining = None
                return None
            self._joining = []
        return concat_generations(rows, self.engine.pad_id())

    # ------------------------------------------------------------------ MFU
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def peak_flops(self, given: float | None = None) -> float:
        """This rank's peak FLOP/s in the engine's dtype: ``given``, else measured once per process (`utils.flops`)."""
        flops.set_peak_flops(given)
        return flops.peak_flops(self.dtype, self.device)

    def _mfu(self, n: int, out: Batch, seconds: float) -> float:
        """Generation's model FLOPs (`utils.flops.generation_counts`) over ``seconds`` and the peak."""
        if self._flops_of is None:
            self._flops_of = flops.TransformerFlops.from_model(build_meta_causal_lm(self.model_path))
        width = out["responses"].shape[1]
        mask = out["attention_mask"]
        prompt_lens = mask[::n, : mask.shape[1] - width].sum(-1).tolist()  # each prompt's (joined rows: n 1)
        response_lens = mask[:, mask.shape[1] - width:].sum(-1).tolist()
        counts = flops.generation_counts(prompt_lens, response_lens)
        return self._flops_of.forward(*counts) / max(seconds, 1e-9) / flops.peak_flops(self.dtype, self.device)

    # ------------------------------------------------------------------ split placement
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def receive_weights(self, sync_key: str, src: int, manifest: Manifest, bucket_bytes: int,
                        version: int, relay_capacity: int = 0) -> dict[str, float]:
        """Receive the weights the actor's `send_weights` broadcasts (collective with it) as ``version``.

        ``relay_capacity`` 0: load them into the engine now (the engine is idle). Positive (asynchronous
        training): keep them in the relay (holding that many versions), which may run while `generate`
        does; the engine loads them at its next trajectory boundary.
        """
        if self.actor_group is not None:
            raise RuntimeError("a colocated rollout gets its weights from the actor at each generate")
        if relay_capacity <= 0:
            stats = receive_weights(self.weights_in, process_group(sync_key), src, manifest, self.dtype,
                                    bucket_bytes, device=self.device)
            self.weight_version = version
            return stats.as_dict()
        if self.relay is None:
            self.relay = WeightRelay(self.weights_in, capacity=relay_capacity)
        inbox = self.relay.inbox()
        stats = receive_weights(inbox, process_group(sync_key), src, manifest, self.dtype, bucket_bytes)
        self.relay.publish(version, inbox)
        return stats.as_dict()

    def _load_from_relay(self, want: int, keep_newer: bool = False, keep_older: bool = False) -> None:
        """Bring the engine to version ``want`` before a trajectory starts (a local copy from the relay).

        ``keep_newer`` (partial rollouts): an engine that already loaded a newer version mid-trajectory keeps
        it (the controller's ``want`` lags the relays by the time the trainer takes to publish).
        ``keep_older`` (repack): carried samples continue with their own, possibly older, version, so the
        relay keeps the versions older than ``want`` (up to its capacity, max_staleness + 2)."""
        if want == self.weight_version or (keep_newer and want < self.weight_version):
            return
        if self.relay is None:
            raise RuntimeError(f"generate asks for weight version {want}; no version was sent to this rank yet")
        self.weight_version = self.relay.load(self.weights_in, want, forget_older=not keep_older)

    def _load_newest(self) -> int:
        """Partial rollouts, between two decode steps: load the relay's newest version if it is newer."""
        newest = self.relay.newest() if self.relay is not None else None
        if newest is not None and newest > self.weight_version:
            self.weight_version = self.relay.load(self.weights_in, newest)
        return self.weight_version

    def close(self) -> None:
        """Stop an engine that runs processes of its own (vLLM), and the agent's tool processes, while the
        process group still exists."""
        if self.harness is not None:
            self.harness.close()
        if self.agent is not None:
            self.agent.close()
        if self.engine is not None:
            self.engine.shutdown()
        self.engine = None

    @register(dispatch=Dispatch.RANK_ZERO)
    def engine_info(self) -> dict[str, Any]:
        """Which engine serves, its TP size and dtype (for logs and benchmarks)."""
        return {"engine": f"{self.engine_cls.__module__}.{self.engine_cls.__qualname__}", "tp_size": self.tp_size,
                "dtype": str(self.dtype), "colocated": self.actor_group is not None}

