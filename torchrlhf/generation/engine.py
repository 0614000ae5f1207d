"""The native generation engine: KV-cached, continuously batched sampling.

Requests are the ``n`` samples of every prompt. A fixed pool of ``max_batch_size``
slots holds the live ones; each slot owns a row of the pre-allocated KV cache
``[layers, slots, max_seq_len, kv_heads, head_dim]``. A finished sample frees its
slot at once and the next waiting sample takes it (continuous batching), so a
long sample never holds the others back. The samples of one prompt share its
prefill: the prompt runs once and its KV prefix is copied into the siblings' slots.

A finished sample's slot keeps its keys/values until the slot is needed again (the prefix cache,
while the weights stay the same): a later prompt that continues it, as an OpenAI-endpoint agent's next
call continues its last one, computes only its new tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrlhf.data.batch import Batch
from torchrlhf.generation.base import (
    RESUME_TAGS,
    assemble_generation,
    assemble_trajectories,
    check_resume_tags,
    check_sessions,
    prompt_max_tokens,
    prompt_seeds,
    prompt_token_lists,
    validate_prompts,
)
from torchrlhf.generation.cuda_graphs import GraphedDecode
from torchrlhf.generation.model import TP_SHARD_DIMS, CachedDecoder
from torchrlhf.generation.prepacked import PrepackedLinears, prepack_supported
from torchrlhf.generation.sampling import SamplingParams, request_uniforms, sample_tokens
from torchrlhf.generation.slots import SlotPool
from torchrlhf.models.loading import quiet_weight_loading
from torchrlhf.models.parallelize import BLOCK_TP_PLAN


def _compiled_decode(decode: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``decode`` through ``torch.compile``, traced once for every span >= 2 (the engine never steps fewer
    slots when compiled): without duck sizing a span equal to the cache's slot count is no special case,
    which would cost another compilation (tens of seconds) the first time the span differs."""
    compiled = torch.compile(decode, dynamic=True)

    def step(*args: Any) -> torch.Tensor:
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return compiled(*args)

    return step


def _right_padded(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows as one right-padded [b, T] tensor and their lengths [b], on ``device``."""
    lens = [len(r) for r in rows]
    toks = torch.zeros(len(rows), max(lens), dtype=torch.long)
    for i, r in enumerate(rows):
        toks[i, : lens[i]] = torch.tensor(r, dtype=torch.long)
    return toks.to(device), torch.tensor(lens, device=device)


def _load_model(path: str | Path, device, dtype) -> nn.Module:
    with quiet_weight_loading():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).to(device)
    # Loaded tensors may be memory-mapped from the file; give them resizable storage
    # that `release` can free (tied parameters are one object, cloned once).
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def _tp_plan(model: nn.Module) -> dict:
    """The training block plan (`models.parallelize.BLOCK_TP_PLAN`) on every layer; embeddings stay replicated."""
    return {f"model.layers.{i}.{name}": style() for i in range(len(model.model.layers))
            for name, style in BLOCK_TP_PLAN.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind a (possibly DTensor) parameter (call under no_grad: same object each time)."""
    return t.to_local() if hasattr(t, "to_local") else t.data


def _ensure_storage(t: torch.Tensor) -> None:
    """Give a tensor whose storage was freed (``resize_(0)``) room for its elements again (uninitialised)."""
    nbytes = (t.storage_offset() + t.numel()) * t.element_size()
    if t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)


class NativeEngine:
    """PyTorch-native generation for Llama / Mistral / Qwen2 / Qwen3 HF models.

    Args:
        model_or_path: an HF causal LM (its parameter tensors are used as they are,
            not copied; it must already be on ``device`` in ``dtype``; its attention
            implementation becomes ``"torchrlhf_sdpa"``, which is SDPA outside the engine)
            or a path to an HF model directory (loaded with safetensors; the engine then
            owns the weights). Generation runs the model's own decoder layers.
        tokenizer: needed for stop strings and the EOS ids; without it EOS comes from
            the model's generation config and stop strings are refused.
        max_batch_size: KV-cache slots, i.e. samples decoded together.
        max_seq_len: longest prompt + response a slot holds.
        device, dtype: where the cache lives and its dtype (default: the model's dtype).
        tp_mesh: a 1-D DeviceMesh for tensor parallelism. The model is converted in
            place by `parallelize_module` (q/k/v/gate/up colwise, o/down rowwise;
            embeddings, norms and lm_head replicated), so pass a model the engine may own.
            Every TP rank must call `generate` with the same prompts and sampling
            params; all ranks then produce identical outputs. With TP the engine
            owns its weights (`release` frees them).
        cuda_graphs: on a CUDA device with TP=1, replay decode steps from captured CUDA
            graphs (`GraphedDecode`); every bucket is captured by the first `generate` after
            construction and after each `resume` (the freed weights and cache come back at new
            addresses), so no later step pays for a capture.
        compile: run the decode step through ``torch.compile`` (inside the CUDA graphs where they are on):
            RMSNorm, RoPE, SwiGLU, residual adds and the in-place KV write fuse into a few kernels instead
            of dozens per layer. The first `generate` pays the compilation (tens of seconds for a 1 B
            model); the tokens are those of the eager step within floating-point rounding.
        cpu_prepack: on CPU in fp32 (and in bf16 where the CPU has bf16 instructions) with TP=1, when the
            engine owns its weights (loaded from a path), run the projections through oneDNN with each
            weight packed once (`PrepackedLinears`) instead of the plain one, which is freed: faster, same
            memory. `update_weights` invalidates the packed copy of every weight it writes.
            A model passed in is never packed, so writes to it by any means are seen. With ``compile`` the
            packed products stay oneDNN's (an opaque op in the compiled step) and the rest of the step fuses.
        check_every: decode steps between two looks of the host at the slots (default: 8 on CUDA, 1 on
            CPU). Stop tokens, length limits and non-finite log-probs are detected on the device; a slot
            that ends stops advancing there, and the host frees it (continuous batching refills it, an
            agent's session gets its turn) at the next look: one host synchronisation per ``check_every``
            steps instead of one or more per step, at the cost of up to ``check_every - 1`` idle steps per
            ended slot. The sampled tokens do not depend on it. Stop strings need the text of every token:
            with ``SamplingParams.stop`` the host looks every step.
        prefix_cache: keep each finished sample's keys/values in its slot until the slot is needed, and
            compute a later prompt that starts with at least half of one of them (and ``slots.MIN_CACHED_PREFIX``
            tokens) from there: an endpoint agent's next call, which repeats its whole conversation, computes
            only the new turn. The cache is dropped by `update_weights` and `release`, and is off for a model
            passed in (its weights can change where the engine cannot see) and in partial rollouts.

    Weight contract for the hybrid engine (`update_weights`):
        * names are the HF model's parameter names (``model.layers.0.self_attn.q_proj.weight``);
          `param_names()` lists them (tied ``lm_head.weight`` is accepted as an alias of
          ``model.embed_tokens.weight``);
        * tensors are this rank's local shard in the generation layout: for a name whose
          `param_shard_dims()` entry is ``d`` (not None), rank ``r`` of the TP mesh passes
          ``torch.chunk(full, tp_size, dim=d)[r]``; replicated names (None) pass the full
          tensor; `param_local_shapes()` gives the expected shapes;
        * values are copied into the engine's buffers (any dtype/device; cast on copy).
    """

    capabilities = frozenset({"partial_rollout", "agent_sessions"})  # agents: parked slots, not rounds

    def __init__(
        self,
        model_or_path: nn.Module | str | Path,
        tokenizer=None,
        *,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        tp_mesh=None,
        cuda_graphs: bool = True,
        cpu_prepack: bool = True,
        check_every: int | None = None,
        compile: bool = False,
        prefix_cache: bool = True,
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        if check_every is not None and check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.device = torch.device(device)
        self.check_every = check_every or (8 if self.device.type == "cuda" else 1)
        if isinstance(model_or_path, (str, Path)):
            model = _load_model(model_or_path, self.device, dtype)
            if tokenizer is None and (Path(model_or_path) / "tokenizer_config.json").is_file():
                tokenizer = AutoTokenizer.from_pretrained(str(model_or_path))
            self.owns_weights = True
        else:
            model = model_or_path
            self.owns_weights = False
            param = next(model.parameters())
            if dtype is not None and param.dtype != dtype:
                raise ValueError(f"model parameters are {param.dtype} but dtype={dtype}; convert the model first")
            if param.device.type != self.device.type:
                raise ValueError(f"model is on {param.device} but device={self.device}; move the model first")
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = next(model.parameters()).dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.tp_mesh = tp_mesh
        self.tp_size = tp_mesh.size() if tp_mesh is not None else 1
        self.tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
        self.decoder = CachedDecoder(model, max_seq_len, self.device, self.dtype)
        self.dims = self.decoder.dims(self.tp_size)
        if self.tp_size > 1:
            parallelize_module(model, tp_mesh, _tp_plan(model))
            self.owns_weights = True  # the sharded projections are new tensors
        self._tied = model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
        self._missing: set[str] = set()
        self.use_cuda_graphs = cuda_graphs and self.device.type == "cuda" and self.tp_size == 1
        self.decode_step = _compiled_decode(self.decoder.decode) if compile else self.decoder.decode
        # a compiled step would specialise on a span of 1 (one more compilation): pad it with a free row
        self.min_decode_span = min(2, max_batch_size) if compile else 1
        self._graphed: GraphedDecode | None = None
        self.prepacked: PrepackedLinears | None = None
        packable = self.owns_weights and self.tp_size == 1 and prepack_supported(self.device, self.dtype)
        if cpu_prepack and packable:
            self.prepacked = PrepackedLinears(model, free_plain=True)
        self.prefix_cache = prefix_cache and self.owns_weights
        self.cached_prefixes: dict[int, list[int]] = {}  # free slot -> the tokens whose keys/values it holds
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self._allocate_cache()

    # ------------------------------------------------------------------ weights
    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def param_names(self) -> list[str]:
        """HF names `update_weights` accepts (tied lm_head listed once, as the embedding)."""
        return list(self._params())

    def param_shard_dims(self) -> dict[str, int | None]:
        """Name -> the dim this engine's TP layout splits it on; None = replicated (always None at TP=1)."""
        out = {}
        for name in self._params():
            dim = next((d for suffix, d in TP_SHARD_DIMS.items() if name.endswith(suffix)), None)
            out[name] = dim if self.tp_size > 1 else None
        return out

    def param_local_shapes(self) -> dict[str, torch.Size]:
        """Name -> the shape of this rank's shard that `update_weights` expects."""
        return {name: _local(p).shape for name, p in self._params().items()}

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, local_shard)`` pairs into the engine's weights, one at a time.

        Streaming-friendly: each tensor is copied and may be freed by the caller right
        after. Unknown names and shape mismatches raise ValueError naming the parameter.
        """
        params = self._params()
        self.cached_prefixes = {}  # computed with the old weights
        for name, tensor in named_tensors:
            if name == "lm_head.weight" and self._tied:
                name = "model.embed_tokens.weight"
            if name not in params:
                raise ValueError(f"update_weights: unknown parameter {name!r} (see NativeEngine.param_names())")
            local = _local(params[name])
            if tuple(tensor.shape) != tuple(local.shape):
                raise ValueError(
                    f"update_weights: {name!r} has shape {tuple(tensor.shape)}, this rank's shard is "
                    f"{tuple(local.shape)} (TP dim {self.param_shard_dims()[name]}, tp_size {self.tp_size})"
                )
            _ensure_storage(local)  # freed by `release`, or packed away by `PrepackedLinears`
            local.copy_(tensor)
            self._missing.discard(name)
            if self.prepacked is not None:
                self.prepacked.invalidate(params[name])

    # ------------------------------------------------------------------ memory
    def _allocate_cache(self) -> None:
        d = self.dims
        shape = (d.num_layers, self.max_batch_size, self.max_seq_len, d.num_kv_heads, d.head_dim)
        self.cached_prefixes = {}
        self.k_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v_cache = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def kv_cache_bytes(self) -> int:
        if self.k_cache is None:
            return 0
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @torch.no_grad()
    def release(self) -> None:
        """Free the KV cache, and the weights when the engine owns them, so training has the memory.

        Weights shared with a model passed in are left alone (freeing them would
        destroy that model). After `resume`, freed weights must be refilled with
        `update_weights` before `generate`.
        """
        self.k_cache = self.v_cache = None
        self.cached_prefixes = {}
        self._graphed = None  # captured on the addresses being freed
        if self.prepacked is not None:
            self.prepacked.clear()
        if self.owns_weights and not self._missing:
            for p in self._params().values():  # named_parameters lists a tied tensor once
                _local(p).untyped_storage().resize_(0)
            self._missing = set(self._params())
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def resume(self, tags: Sequence[str] = RESUME_TAGS) -> None:
        """Re-allocate what `release` freed: ``"weights"`` (uninitialised until `update_weights`), ``"kv_cache"``."""
        tags = check_resume_tags(tags)
        if "weights" in tags and self._missing:
            for p in self._params().values():
                _ensure_storage(_local(p))
        if "kv_cache" in tags and self.k_cache is None:
            self._allocate_cache()

    # ------------------------------------------------------------------ generate
    def decode_fn(self):
        """The decode step to call: graph replay where enabled (every bucket captured on the first call after
        construction or `resume`), else `decode_step` (`CachedDecoder.decode`, compiled or not)."""
        if not self.use_cuda_graphs:
            return self.decode_step
        if self._graphed is None:
            self._graphed = GraphedDecode(self.decode_step, self.k_cache, self.v_cache)
            self._graphed.capture_all()
        return self._graphed

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            eos = [getattr(self.model.generation_config, "eos_token_id", None)]
            if self.tokenizer is not None:
                eos.append(self.tokenizer.eos_token_id)
            for e in eos:
                ids.extend(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
        return sorted(set(ids))

    def _pad_id(self) -> int:
        for source in (self.tokenizer, self.model.generation_config, self.model.config):
            pid = getattr(source, "pad_token_id", None) if source is not None else None
            if pid is not None:
                return int(pid)
        stops = self._stop_ids(SamplingParams())
        return stops[0] if stops else 0

    @torch.inference_mode()
    def generate(self, prompts: Batch, sampling: SamplingParams | None = None, *,
                 between_steps: Callable[[], int] | None = None, sessions: Sequence[Any] | None = None) -> Batch:
        """Sample ``sampling.n`` responses for each left-padded prompt of ``prompts``.

        Reads ``input_ids``/``attention_mask`` [B, P]. Returns B*n rows (samples of one
        prompt adjacent) with ``prompts``, ``responses`` [B*n, max_tokens] (right-padded
        with the pad id), ``input_ids``, ``attention_mask``, ``position_ids``,
        ``response_mask``, ``rollout_log_probs`` (float32, 0 on padding) and
        ``finish_reason`` (``rollout_log_probs`` only when ``sampling.logprobs``); every other column of ``prompts`` is repeated n times.

        ``between_steps`` (partial rollouts): called before every prefill and decode step; it may load new
        weights (`update_weights`) and returns their version, recorded for each token the step produces in
        ``token_weight_versions`` [B*n, max_tokens]. The cached keys/values of earlier tokens stay as they
        were computed; each token's ``rollout_log_probs`` is from the weights that sampled it.

        ``sessions`` (agents, `torchrlhf.agents.AgentSession`, one per sample: prompt i's samples at
        ``i*n .. i*n+n-1``): multi-turn trajectories. Each starts from its session's prompt tokens; when the
        model ends a turn its session runs the tools or the environment while the other slots keep
        decoding, and only the observation is prefilled on the trajectory's cached keys/values. Returns
        `assemble_trajectories`' columns (observations inside the responses, 0 in ``response_mask``).
        """
        params = sampling or SamplingParams()
        if self.k_cache is None or self._missing:
            missing = sorted(self._missing)[:5]
            raise RuntimeError(
                "NativeEngine.generate after release(): call resume() and update_weights() first"
                + (f" (missing weights, e.g. {missing})" if missing else "")
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; pass one to NativeEngine")
        if sessions is None:
            validate_prompts(prompts, params, self.max_seq_len)
        else:
            check_sessions(sessions, self.max_seq_len)
        prompt_tokens = prompt_token_lists(prompts)
        if self.prepacked is not None:
            self.prepacked.refresh()
        run = _Run(self, params, prompt_tokens, prompt_seeds(prompts, params, self.tp_mesh),
                   prompt_max_tokens(prompts, params), between_steps, sessions)
        tokens, logps, resp_len, reasons = run.run()
        if sessions is not None:
            versions = run.res_ver if between_steps is not None else None
            return assemble_trajectories(prompts, params, [s.result() for s in sessions], logps, self._pad_id(),
                                         versions)
        out = self._assemble(prompts, params, tokens, logps, resp_len, reasons)
        if between_steps is not None:
            out["token_weight_versions"] = (run.res_ver * out["response_mask"].cpu()).to(out["responses"].device)
        return out

    def _assemble(self, prompts: Batch, params: SamplingParams, tokens, logps, resp_len, reasons) -> Batch:
        return assemble_generation(prompts, params, tokens, logps, resp_len, reasons, self._pad_id())


class _Run:
    """The scheduling state of one `generate` call.

    Sample ``sid`` answers prompt ``sid // n`` (its ``sid % n``-th sample). Samples whose prompts have the
    same tokens share one prefill (``prompt_of``: the prompt tokens each sample starts from). With agent
    ``sessions`` (one per sample) a sample is a multi-turn trajectory: when the model ends a turn its slot
    is *parked* (keeps its keys/values, skips decode steps) until the session's observation is ready, then
    only the observation is prefilled into the slot (in the next decode step's forward where that step
    runs eagerly, `CachedDecoder.decode_and_extend`; else in one of its own, `CachedDecoder.extend`) and
    decoding goes on; the model-token counter (``step``) runs over all turns, so the sampling uniforms and
    the log-probs of one trajectory are one sequence.

    Slots that hold no sample take the scratch position ``max_seq_len - 1`` in decode steps (a free row's
    keys/values are written somewhere): never a position of a cached prefix, which holds at most
    ``max_seq_len - 1`` tokens.
    """

    def __init__(self, engine: NativeEngine, params: SamplingParams, prompt_tokens, seeds, limits,
                 between_steps: Callable[[], int] | None = None, sessions: Sequence[Any] | None = None) -> None:
        self.e, self.p = engine, params
        self.between_steps, self.version = between_steps, 0  # the weight version the next step uses
        self.decode = engine.decode_fn()
        self.seeds, self.sessions = seeds, sessions
        dev, slots, steps = engine.device, engine.max_batch_size, params.max_tokens
        self.scratch = engine.max_seq_len - 1
        # The prefix cache (free slot -> tokens it holds), taken from the engine and given back by `run`; with
        # weights that may change between steps it is neither used nor filled.
        use_cache = engine.prefix_cache and between_steps is None
        self.slots = SlotPool(slots, engine.cached_prefixes if use_cache else {})
        engine.cached_prefixes = {}
        self.record = use_cache and sessions is None  # an agent's slot also holds observations: not recorded
        total = len(prompt_tokens) * params.n
        if sessions is None:
            self.prompt_tokens = prompt_tokens
            self.prompt_of = [sid // params.n for sid in range(total)]
            self.limits = [limits[sid // params.n] for sid in range(total)]  # tokens a response may have
        else:  # each trajectory's own first context (an environment may write it); equal ones share a prefill
            if len(sessions) != total:
                raise ValueError(f"generate: {len(sessions)} agent sessions for {total} samples")
            unique: dict[tuple[int, ...], int] = {}
            self.prompt_of = [unique.setdefault(tuple(s.prompt_tokens), len(unique)) for s in sessions]
            self.prompt_tokens = [torch.tensor(t, dtype=torch.long) for t in unique]
            self.limits = [s.turn_budget() for s in sessions]
        self.prompt_lists = [t.tolist() for t in self.prompt_tokens]
        # Per-slot decode state, pre-allocated; rows of free slots hold junk that no one reads.
        self.cur = torch.zeros(slots, dtype=torch.long, device=dev)
        self.pos = torch.full((slots,), self.scratch, dtype=torch.long, device=dev)
        self.step = torch.zeros(slots, dtype=torch.long, device=dev)
        self.live = torch.zeros(slots, dtype=torch.long, device=dev)
        self.limit = torch.zeros(slots, dtype=torch.long, device=dev)
        self.out_tok = torch.zeros(slots, steps, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(slots, steps, dtype=torch.float32, device=dev)
        self.out_ver = torch.zeros(slots, steps, dtype=torch.long, device=dev)
        self.uni = torch.zeros(slots, steps, dtype=torch.float64, device=dev)
        self.stop_ids = torch.tensor(engine._stop_ids(params), dtype=torch.long, device=dev)
        self.ended_by_stop = torch.zeros(slots, dtype=torch.bool, device=dev)  # the turn's last token is a stop id
        self.nonfinite = torch.zeros(slots, dtype=torch.bool, device=dev)  # a sampled log-prob was NaN or inf
        self.check_every = 1 if params.stop else engine.check_every  # stop strings: the host reads every token
        self.since_look = 0
        # Results, by sample id (prompt i, sample j -> i * n + j): the model's tokens (all turns).
        self.res_tok = torch.zeros(total, steps, dtype=torch.long)
        self.res_lp = torch.zeros(total, steps, dtype=torch.float32)
        self.res_ver = torch.zeros(total, steps, dtype=torch.long)
        self.res_len = torch.zeros(total, dtype=torch.long)
        self.reasons: list[str] = [""] * total
        # Python-side bookkeeping. A session that is already done (its environment failed to reset, no
        # budget left) takes no slot.
        self.waiting = deque(sid for sid in range(total) if sessions is None or self.limits[sid] > 0)
        self.slot_sample = [-1] * slots
        self.slot_pos = [0] * slots  # position the slot's next token goes to
        self.slot_turn: dict[int, int] = {}  # agents: the model-token index the slot's current turn started at
        self.parked: dict[int, Any] = {}  # agents: slot -> the future of its session's turn result
        # agents: parked slots whose observation rides in the next decode step's forward (slot -> its tokens);
        # only where decode steps run eagerly (a graphed or compiled step has a fixed shape)
        self.ready: dict[int, list[int]] = {}
        # the plain eager step (each attribute access makes a new bound method, so compare with ==)
        self.ride_along = sessions is not None and self.decode == engine.decoder.decode
        self.prompt_slots: dict[int, set[int]] = {}
        self.prompt_logits: dict[int, torch.Tensor] = {}
        self.prompt_version: dict[int, int] = {}  # the weights each cached prefill's logits came from
        self.to_admit = {p: 0 for p in set(self.prompt_of)}
        for sid in self.waiting:
            self.to_admit[self.prompt_of[sid]] += 1
        self.gen_text: dict[int, list[int]] = {}  # stop strings: the slot's turn's tokens the host has read
        self.stop_window = max((len(s) for s in params.stop), default=0) + 4

    # ---------------------------------------------------------------- admission
    def _admit(self) -> None:
        e, n = self.e, self.p.n
        taken = []
        computed: dict[int, int] = {}  # prompt -> the slot it is computed into now
        prefill, extend = [], []  # prompts computed whole; (prompt, tokens already cached in its slot)
        reuse, copies = [], []  # (dst, src, length) cached-prefix copies; (dst, src, prompt) prompt shares
        while self.waiting and self.slots.free:
            sid = self.waiting.popleft()
            p = self.prompt_of[sid]
            live = self.prompt_slots.get(p)
            if live or p in computed:
                slot = self.slots.take()
                copies.append((slot, next(iter(live)) if live else computed[p], p))
            else:
                slot, cached, source = self.slots.place(self.prompt_lists[p])
                if source is not None:
                    reuse.append((slot, source, cached))
                computed[p] = slot
                if cached:
                    extend.append((p, cached))
                else:
                    prefill.append(p)
            taken.append((sid, slot))
        if reuse:  # before anything is written: a source may be taken by a later prompt of this admission
            dst = torch.tensor([d for d, _, _ in reuse], device=e.device)
            src = torch.tensor([s for _, s, _ in reuse], device=e.device)
            span = max(length for _, _, length in reuse)
            e.k_cache[:, dst, :span] = e.k_cache[:, src, :span]
            e.v_cache[:, dst, :span] = e.v_cache[:, src, :span]
        if prefill:
            toks, lens = _right_padded([self.prompt_lists[p] for p in prefill], e.device)
            logits = e.decoder.prefill(toks, lens, torch.tensor([computed[p] for p in prefill], device=e.device),
                                       e.k_cache, e.v_cache)
            self._keep_prompt_logits(prefill, logits)
        if extend:  # only the tokens after the cached prefix
            toks, lens = _right_padded([self.prompt_lists[p][cached:] for p, cached in extend], e.device)
            logits = e.decoder.extend(toks, torch.tensor([c for _, c in extend], device=e.device), lens,
                                      torch.tensor([computed[p] for p, _ in extend], device=e.device),
                                      e.k_cache, e.v_cache)
            self._keep_prompt_logits([p for p, _ in extend], logits)
        if copies:
            dst = torch.tensor([d for d, _, _ in copies], device=e.device)
            src = torch.tensor([s for _, s, _ in copies], device=e.device)
            span = max(len(self.prompt_lists[p]) for _, _, p in copies)
            e.k_cache[:, dst, :span] = e.k_cache[:, src, :span]
            e.v_cache[:, dst, :span] = e.v_cache[:, src, :span]

        slots = [slot for _, slot in taken]
        slot_t = torch.tensor(slots, device=e.device)
        logits = torch.stack([self.prompt_logits[self.prompt_of[sid]] for sid, _ in taken])
        self.uni[slot_t] = torch.stack(
            [request_uniforms(self.seeds[sid // n], sid % n, self.p.max_tokens) for sid, _ in taken]
        ).to(e.device)
        tok, lp = sample_tokens(logits, self.uni[slot_t, 0], self.p, check_finite=False)
        self.out_tok[slot_t, 0] = tok
        self.out_lp[slot_t, 0] = lp
        if self.between_steps is not None:
            self.out_ver[slot_t, 0] = torch.tensor([self.prompt_version[self.prompt_of[sid]] for sid, _ in taken],
                                                   device=e.device)
        self.cur[slot_t] = tok
        lens = [len(self.prompt_tokens[self.prompt_of[sid]]) for sid, _ in taken]
        self.pos[slot_t] = torch.tensor(lens, device=e.device)
        self.step[slot_t] = 1
        self.live[slot_t] = 1
        self.ended_by_stop[slot_t] = False
        self.limit[slot_t] = torch.tensor([self.limits[sid] for sid, _ in taken], device=e.device)
        for (sid, slot), length in zip(taken, lens):
            p = self.prompt_of[sid]
            self.slot_sample[slot] = sid
            self.slot_pos[slot] = length
            self.slot_turn[slot] = 0
            self.prompt_slots.setdefault(p, set()).add(slot)
            self.to_admit[p] -= 1
            if self.to_admit[p] == 0:
                del self.prompt_logits[p]
        self._end_on_device(slot_t, tok, lp)
        # A sample that ends at its first token (a budget of one token, or a stop token where the host looks
        # every step) is freed now, not after a decode step that would compute nothing for it.
        if self.check_every == 1 or any(self.limits[sid] == 1 for sid, _ in taken):
            self._look()

    def _keep_prompt_logits(self, prompts: list[int], logits: torch.Tensor) -> None:
        for row, p in enumerate(prompts):
            self.prompt_logits[p] = logits[row]
            self.prompt_version[p] = self.version

    # ---------------------------------------------------------------- finishing
    def _end_on_device(self, slot_t: torch.Tensor, tok: torch.Tensor, lp: torch.Tensor) -> None:
        """End, on the device and without a host synchronisation, the turn of each live slot of ``slot_t``
        whose newest token ``tok`` is a stop id or reaches its limit: the slot stops advancing until the
        host's next `_look` frees it. Free and parked slots (not live) are left alone."""
        live = self.live[slot_t].bool()
        hit = torch.isin(tok, self.stop_ids) & live
        ended = hit | (live & (self.step[slot_t] >= self.limit[slot_t]))
        self.ended_by_stop[slot_t] |= hit
        self.nonfinite[slot_t] |= live & ~torch.isfinite(lp)
        self.live[slot_t] = (live & ~ended).long()

    def _look(self) -> None:
        """The host's look at the decoding slots, one synchronisation: free those whose turn ended on the
        device (an agent's turn goes to its session), catch up ``slot_pos``, check stop strings."""
        self.since_look = 0
        slots = [s for s, sid in enumerate(self.slot_sample) if sid >= 0 and s not in self.parked]
        if not slots:
            return
        slot_t = torch.tensor(slots, device=self.e.device)
        state = torch.stack([self.live[slot_t], self.ended_by_stop[slot_t].long(), self.pos[slot_t],
                             self.step[slot_t], self.nonfinite[slot_t].long()])
        live, stopped, pos, step, bad = state.tolist()
        if any(bad):
            sids = [self.slot_sample[s] for s, b in zip(slots, bad) if b]
            raise FloatingPointError(
                f"generate: the next-token distribution of samples {sids[:8]} is not finite (NaN or inf logits): "
                "the model's weights or activations are not finite (a corrupt checkpoint, or an overflow in "
                "float16/bfloat16)"
            )
        for s, p in zip(slots, pos):
            self.slot_pos[s] = p
        if self.p.stop:
            self._check_stop_strings(slots, live, stopped, step)
        ended = [(s, bool(st), n) for s, lv, st, n in zip(slots, live, stopped, step) if not lv]
        if not ended:
            return
        if self.sessions is None:
            self._finish([s for s, _, _ in ended], ["stop" if st else "length" for _, st, _ in ended])
        else:
            self._end_turns(ended)

    def _check_stop_strings(self, slots: list[int], live: list[int], stopped: list[int], step: list[int]) -> None:
        """End each live slot whose text now holds a stop string, at the token that completed it (``live``,
        ``stopped`` and ``step`` are updated in place, and on the device)."""
        rows = self.out_tok[torch.tensor(slots, device=self.e.device)].tolist()
        tokenizer = self.e.tokenizer
        for i, s in enumerate(slots):
            if not live[i]:
                continue
            text_ids = self.gen_text.setdefault(s, [])
            start = self.slot_turn.get(s, 0) + len(text_ids)
            for j in range(start, step[i]):
                text_ids.append(rows[i][j])
                tail = tokenizer.decode(text_ids[-self.stop_window :], skip_special_tokens=False)
                if any(stop in tail for stop in self.p.stop):  # tokens after j were sampled past the end
                    back = step[i] - (j + 1)
                    live[i], stopped[i], step[i] = 0, 1, j + 1
                    self.slot_pos[s] -= back
                    self.live[s], self.step[s], self.cur[s], self.pos[s] = 0, j + 1, rows[i][j], self.slot_pos[s]
                    break

    def _finish(self, slots: list[int], reasons: list[str]) -> None:
        sids = [self.slot_sample[s] for s in slots]
        slot_t = torch.tensor(slots, device=self.e.device)
        sid_t = torch.tensor(sids)
        self.res_tok[sid_t] = self.out_tok[slot_t].cpu()
        self.res_lp[sid_t] = self.out_lp[slot_t].cpu()
        self.res_ver[sid_t] = self.out_ver[slot_t].cpu()
        self.res_len[sid_t] = self.step[slot_t].cpu()
        self.live[slot_t] = 0
        self.pos[slot_t] = self.scratch
        self.step[slot_t] = 0
        self.ended_by_stop[slot_t] = False
        for s, sid, reason in zip(slots, sids, reasons):
            self.reasons[sid] = reason
            p = self.prompt_of[sid]
            self.prompt_slots[p].discard(s)
            holds = None
            if self.record:  # the slot holds the prompt and every sampled token but the last (never fed)
                holds = self.prompt_lists[p] + self.res_tok[sid, : int(self.res_len[sid]) - 1].tolist()
            self.slots.give_back(s, holds)
            self.slot_sample[s] = -1
            self.slot_pos[s] = 0
            self.slot_turn.pop(s, None)
            self.gen_text.pop(s, None)

    # ---------------------------------------------------------------- agent turns
    def _end_turns(self, ended: list[tuple[int, bool, int]]) -> None:
        """Agents: hand each ended turn (slot, ended by a stop, model tokens so far) to its session and
        park the slot until the session answers."""
        rows = self.out_tok[torch.tensor([s for s, _, _ in ended], device=self.e.device)].tolist()
        for (s, stopped, step), row in zip(ended, rows):
            turn = row[self.slot_turn[s] : step]
            self.parked[s] = self.sessions[self.slot_sample[s]].end_turn(turn, "stop" if stopped else "length")
            self.gen_text.pop(s, None)

    def _resume_ready(self, block: bool, decoding: bool) -> bool:
        """Agents: finish the parked trajectories that are done, and continue those whose observation is
        ready by prefilling only it: in the next decode step's forward where it can (``ride_along``, while
        other slots decode), else now. With ``block``, first wait for one (nothing else can run). Returns
        whether any slot changed."""
        waiting = {s: f for s, f in self.parked.items() if s not in self.ready}
        if not waiting:
            return False
        if block:
            wait(list(waiting.values()), return_when=FIRST_COMPLETED)
        done = [(s, f.result()) for s, f in waiting.items() if f.done()]
        if not done:
            return False
        finished = [s for s, r in done if r.done]
        for s in finished:
            del self.parked[s]
        if finished:
            self._finish(finished, [""] * len(finished))  # the session holds the reason
        going = [(s, r.observation_tokens) for s, r in done if not r.done]
        if going and self.ride_along and decoding:
            self.ready.update(going)  # they stay parked until that step
        elif going:
            for s, _ in going:
                del self.parked[s]
            self._observe(going, self._extend(going))
        return True

    def _extension(self, going: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, ...]:
        """The `CachedDecoder.extend` inputs that append ``[last sampled token] + observation`` to each slot:
        right-padded tokens, start positions, lengths, slots."""
        dev = self.e.device
        toks, lens = _right_padded([[int(self.cur[s].item()), *obs] for s, obs in going], dev)
        return (toks, torch.tensor([self.slot_pos[s] for s, _ in going], device=dev), lens,
                torch.tensor([s for s, _ in going], device=dev))

    def _extend(self, going: list[tuple[int, list[int]]]) -> torch.Tensor:
        e = self.e
        return e.decoder.extend(*self._extension(going), e.k_cache, e.v_cache)

    def _observe(self, going: list[tuple[int, list[int]]], logits: torch.Tensor) -> None:
        """Each slot's observation has been prefilled (``logits`` at its last token): sample the slot's next
        turn's first token and make it live."""
        e = self.e
        slots = [s for s, _ in going]
        slot_t = torch.tensor(slots, device=e.device)
        starts = [self.slot_pos[s] for s in slots]
        lens = [1 + len(obs) for _, obs in going]
        step = self.step[slot_t]
        tok, lp = sample_tokens(logits, self.uni[slot_t, step], self.p, check_finite=False)
        self.out_tok[slot_t, step] = tok
        self.out_lp[slot_t, step] = lp
        if self.between_steps is not None:
            self.out_ver[slot_t, step] = self.version
        budgets = [self.sessions[self.slot_sample[s]].turn_budget() for s in slots]
        self.limit[slot_t] = step + torch.tensor(budgets, device=e.device)
        self.cur[slot_t] = tok
        self.pos[slot_t] = torch.tensor([a + b for a, b in zip(starts, lens)], device=e.device)
        self.step[slot_t] = step + 1
        self.live[slot_t] = 1
        self.ended_by_stop[slot_t] = False
        for s, first, length in zip(slots, step.tolist(), lens):
            self.slot_turn[s] = first
            self.slot_pos[s] += length
        self._end_on_device(slot_t, tok, lp)

    # ---------------------------------------------------------------- decode
    def _compact(self, live: list[int]) -> None:
        """Move live samples into the lowest slots so decode runs over a short span."""
        targets = [s for s in range(len(live)) if self.slot_sample[s] < 0]
        movers = [s for s in live if s >= len(live)]
        if not movers:
            return
        e = self.e
        kv_len = max(self.slot_pos[s] for s in movers) + 1
        dst, src = torch.tensor(targets, device=e.device), torch.tensor(movers, device=e.device)
        e.k_cache[:, dst, :kv_len] = e.k_cache[:, src, :kv_len]
        e.v_cache[:, dst, :kv_len] = e.v_cache[:, src, :kv_len]
        for t in (self.cur, self.pos, self.step, self.live, self.limit, self.out_tok, self.out_lp, self.out_ver,
                  self.uni, self.ended_by_stop, self.nonfinite):
            t[dst] = t[src]
        self.live[src] = 0
        self.pos[src] = self.scratch
        self.step[src] = 0
        for d, s in zip(targets, movers):
            self.slots.move(d, s)
            sid = self.slot_sample[s]
            self.slot_sample[d], self.slot_sample[s] = sid, -1
            self.slot_pos[d], self.slot_pos[s] = self.slot_pos[s], 0
            slots = self.prompt_slots[self.prompt_of[sid]]
            slots.discard(s)
            slots.add(d)
            for per_slot in (self.gen_text, self.slot_turn, self.parked, self.ready):
                if s in per_slot:
                    per_slot[d] = per_slot.pop(s)

    def _decode_step(self) -> None:
        e = self.e
        live = [s for s, sid in enumerate(self.slot_sample) if sid >= 0]
        span = live[-1] + 1
        if not self.waiting and span >= 8 and len(live) <= span // 2:
            self._compact(live)
            live = list(range(len(live)))
            span = len(live)
        span = max(span, e.min_decode_span)
        kv_len = max(self.slot_pos[s] for s in live) + 1
        riding = list(self.ready.items())
        self.ready = {}
        if riding:
            logits, riding_logits = e.decoder.decode_and_extend(self.cur[:span], self.pos[:span], span, kv_len,
                                                                *self._extension(riding), e.k_cache, e.v_cache)
        else:
            logits = self.decode(self.cur[:span], self.pos[:span], span, kv_len, e.k_cache, e.v_cache)
        rows = torch.arange(span, device=e.device)
        step = self.step[:span].clamp(max=self.p.max_tokens - 1)
        live_t = self.live[:span]
        tok, lp = sample_tokens(logits, self.uni[rows, step], self.p, check_finite=False)
        # Rows that are not live (free, parked, or ended since the host's last look) are junk: they keep
        # their token and write nothing.
        keep = live_t.bool()
        tok = torch.where(keep, tok, self.cur[:span])
        self.out_tok[rows, step] = torch.where(keep, tok, self.out_tok[rows, step])
        self.out_lp[rows, step] = torch.where(keep, lp, self.out_lp[rows, step])
        if self.between_steps is not None:
            self.out_ver[rows, step] = torch.where(keep, self.version, self.out_ver[rows, step])
        self.cur[:span] = tok
        self.pos[:span] += live_t
        self.step[:span] += live_t
        for s in live:
            if s not in self.parked:
                self.slot_pos[s] += 1  # an upper bound until the next look: a slot may have ended since
        self._end_on_device(rows, tok, lp)
        if riding:
            for s, _ in riding:
                del self.parked[s]
            self._observe(riding, riding_logits)
        self.since_look += 1
        if self.since_look >= self.check_every:
            self._look()

    def _refresh(self) -> None:
        """Partial rollouts: let the caller swap weights in between two steps."""
        if self.between_steps is None:
            return
        version = int(self.between_steps())
        if version != self.version and self.e.prepacked is not None:
            self.e.prepacked.refresh()  # repack what `update_weights` wrote
        self.version = version

    def run(self):
        while self.waiting or any(sid >= 0 for sid in self.slot_sample):
            self._refresh()
            decoding = any(sid >= 0 and s not in self.parked for s, sid in enumerate(self.slot_sample))
            if self._resume_ready(not decoding and not (self.waiting and self.slots.free), decoding):
                continue
            if self.waiting and self.slots.free:
                self._admit()
                continue
            if decoding:
                self._decode_step()
        self.e.cached_prefixes = self.slots.cached
        return self.res_tok, self.res_lp, self.res_len, self.reasons
