"""The native generation engine: KV-cached, continuously batched sampling.

Requests are the ``n`` samples of every prompt. A fixed pool of ``max_batch_size``
slots holds the live ones; each slot owns a row of the pre-allocated KV cache
(`KVCache`). A finished sample frees its slot at once and the next waiting sample
takes it (continuous batching, `Scheduler`), so a long sample never holds the others
back. The samples of one prompt share its prefill: the prompt runs once and its KV
prefix is copied into the siblings' slots.

A finished sample's slot keeps its keys/values until the slot is needed again (the prefix cache,
while the weights stay the same): a later prompt that continues it, as an OpenAI-endpoint agent's next
call continues its last one, computes only its new tokens.

This module owns the weights (loading, TP, packing, `update_weights`), the memory (`release`,
`resume`) and `generate`; the scheduling of one call is `scheduler.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from torchrlhf.data.batch import Batch
from torchrlhf.generation.base import (
    CARRIED_COLUMNS,
    RESUME_TAGS,
    CarriedSample,
    assemble_generation,
    assemble_trajectories,
    carried_samples,
    check_resume_tags,
    check_sessions,
    concat_generations,
    prompt_max_tokens,
    prompt_seeds,
    prompt_token_lists,
    validate_prompts,
)
from torchrlhf.generation.cuda_graphs import GraphedDecode
from torchrlhf.generation.decode_attention import available as decode_kernel_available
from torchrlhf.generation.kv_cache import KVCache
from torchrlhf.generation.model import TP_SHARD_DIMS, CachedDecoder
from torchrlhf.generation.prepacked import PrepackedLinears, prepack_supported
from torchrlhf.generation.sampling import SamplingParams
from torchrlhf.generation.scheduler import AgentTurns, Repack, Scheduler, SingleTurn
from torchrlhf.generation.session import Session
from torchrlhf.models.expert_parallel import split_experts_over_tp
from torchrlhf.models.loading import quiet_weight_loading
from torchrlhf.models.moe import install_routers, routers
from torchrlhf.models.parallelize import split_blocks_over_tp
from torchrlhf.utils.compile_cache import compile_ahead
from torchrlhf.utils.pystack import in_fresh_stack_chunk


def _compiled_decode(decode: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``decode`` through ``torch.compile``, traced once for every span >= 2 (the engine never steps fewer
    slots when compiled; `compile_ahead` traces sizes without duck sizing), and saved: a second process on
    this machine loads the step instead of tracing every layer again."""
    return compile_ahead(decode, "decode", dynamic=True)


def _decode_kernel(choice: str, device: torch.device) -> bool:
    """Whether decode steps attend through the Triton kernel (``NativeEngine(decode_attention=)``)."""
    if choice not in ("auto", "sdpa", "triton"):
        raise ValueError(f"decode_attention must be 'auto', 'sdpa' or 'triton', got {choice!r}")
    runs = decode_kernel_available(device)
    if choice == "triton" and not runs:
        raise ValueError(f"decode_attention='triton' needs a CUDA device and the triton package; the engine is on "
                         f"{device}{'' if decode_kernel_available(torch.device('cuda')) else ' without triton'}")
    return choice == "triton" or (choice == "auto" and runs)


def _load_model(path: str | Path, device, dtype) -> nn.Module:
    with quiet_weight_loading():
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or torch.float32).to(device)
    # Loaded tensors may be memory-mapped from the file; give them resizable storage
    # that `release` can free (tied parameters are one object, cloned once).
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind a (possibly DTensor) parameter (call under no_grad: same object each time)."""
    return t.to_local() if hasattr(t, "to_local") else t.data


def _ensure_storage(t: torch.Tensor) -> None:
    """Give a tensor whose storage was freed (``resize_(0)``) room for its elements again (uninitialised)."""
    nbytes = (t.storage_offset() + t.numel()) * t.element_size()
    if t.untyped_storage().nbytes() < nbytes:
        t.untyped_storage().resize_(nbytes)


class NativeEngine:
    """PyTorch-native generation for Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE HF models.

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
            place by `models.parallelize.split_blocks_over_tp` (q/k/v/gate/up colwise,
            o/down rowwise, plain tensors; embeddings, norms and lm_head replicated; a mixture-of-experts block keeps
            ``experts / tp`` experts per rank, `models.expert_parallel.split_experts_over_tp`),
            so pass a model the engine may own.
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
        record_routes: a mixture-of-experts model returns, with each generation, the experts every response
            token was routed to as the input of the step after it (``routed_experts`` [B*n, max_tokens,
            moe_layers, top_k], int16; index t for token t, zeros where no step fed it), for routing replay
            in training (``actor.moe.router_replay: rollout``). Single-turn generation with the eager decode step
            only (the compiled and graphed steps cannot hand the routers' choices out).
        decode_attention: how a decode step attends: ``"triton"``, the flash-decoding kernel
            (`generation.decode_attention`: each slot reads only its own keys, the query heads of a KV head
            together), CUDA only; ``"sdpa"``, SDPA under a mask up to the step's KV bucket; ``"auto"`` (default),
            the kernel where it runs, else SDPA (the faster on a CPU).

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

    capabilities = frozenset({"partial_rollout", "agent_sessions", "repack"})  # agents: parked slots, not rounds

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
        record_routes: bool = False,
        decode_attention: str = "auto",
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
        install_routers(model)  # the training model's router (`models.moe`; same parameters), for one definition
        self.model = model
        self.tokenizer = tokenizer
        self.dtype = next(model.parameters()).dtype
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.tp_mesh = tp_mesh
        self.tp_size = tp_mesh.size() if tp_mesh is not None else 1
        self.tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
        self.decoder = CachedDecoder(model, max_seq_len, self.device, self.dtype,
                                     decode_kernel=_decode_kernel(decode_attention, self.device))
        self.dims = self.decoder.dims(self.tp_size)
        if self.tp_size > 1:
            split_blocks_over_tp(model, tp_mesh)
            split_experts_over_tp(model, tp_mesh)  # a mixture-of-experts model's experts: a share per TP rank
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
        self.routes = self._route_shape(model) if record_routes else None
        if self.routes is not None and (compile or self.use_cuda_graphs):
            raise ValueError("NativeEngine(record_routes=True) runs the eager decode step: set compile=False and "
                             "cuda_graphs=False")
        self.cache: KVCache | None = None
        self._allocate_cache()

    @staticmethod
    def _route_shape(model: nn.Module) -> tuple[int, int]:
        """(MoE layers, top_k) of the routes `generate` records."""
        found = routers(model)
        if not found:
            raise ValueError(f"NativeEngine(record_routes=True): the model ({model.config.model_type}) has no "
                             "mixture-of-experts router")
        return len(found), found[0].top_k

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

    def load_groups(self) -> list[set[str]]:
        """None: each weight loads on its own (q/k/v are separate tensors here)."""
        return []

    def shutdown(self) -> None:
        """Nothing runs beside this process: the role's close frees the engine with it."""

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
        if self.cache is not None:
            self.cache.prefixes = {}  # computed with the old weights
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
        self.cache = KVCache(self.dims, self.max_batch_size, self.max_seq_len, self.device, self.dtype)

    def kv_cache_bytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()

    @torch.no_grad()
    def release(self) -> None:
        """Free the KV cache, and the weights when the engine owns them, so training has the memory.

        Weights shared with a model passed in are left alone (freeing them would
        destroy that model). After `resume`, freed weights must be refilled with
        `update_weights` before `generate`.
        """
        self.cache = None
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
        if "kv_cache" in tags and self.cache is None:
            self._allocate_cache()

    # ------------------------------------------------------------------ generate
    def decode_fn(self):
        """The decode step to call: graph replay where enabled (every bucket captured on the first call after
        construction or `resume`), else `decode_step` (`CachedDecoder.decode`, compiled or not)."""
        if not self.use_cuda_graphs:
            return self.decode_step
        if self._graphed is None:
            self._graphed = GraphedDecode(self.decode_step, self.cache.k, self.cache.v)
            self._graphed.capture_all()
        return self._graphed

    def stop_ids(self, params: SamplingParams) -> list[int]:
        """The token ids that end a response: ``params.stop_token_ids`` and, unless ``ignore_eos``, EOS."""
        ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            eos = [getattr(self.model.generation_config, "eos_token_id", None)]
            if self.tokenizer is not None:
                eos.append(self.tokenizer.eos_token_id)
            for e in eos:
                ids.extend(e if isinstance(e, (list, tuple)) else [] if e is None else [e])
        return sorted(set(ids))

    def pad_id(self) -> int:
        """The id that pads responses: the tokenizer's, the generation config's or the model's, else a stop id."""
        for source in (self.tokenizer, self.model.generation_config, self.model.config):
            pid = getattr(source, "pad_token_id", None) if source is not None else None
            if pid is not None:
                return int(pid)
        stops = self.stop_ids(SamplingParams())
        return stops[0] if stops else 0

    @torch.inference_mode()
    def generate(self, prompts: Batch, sampling: SamplingParams | None = None, *,
                 between_steps: Callable[[], int] | None = None, sessions: Sequence[Session] | None = None,
                 release_below: float | None = None, more_carried: Callable[[bool], Batch | None] | None = None,
                 ) -> Batch:
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

        Repack (Laminar; single turn): ``release_below`` (a fraction of ``max_batch_size``) stops the call once
        no sample waits and its decoding slots, having reached that many, fall below it; the unfinished samples
        come back as they are, with finish reason ``"carried"``. A prompt batch with the `CARRIED_COLUMNS`
        (``n`` 1) continues such samples: each context is its prompt and the tokens it sampled (prefilled
        again: the keys/values stay on the replica that computed them), and it samples on with its own
        uniforms, so it continues token for token as it would have where it started (within floating-point
        rounding of a prefill against decode steps). The response holds every token, the carried ones with
        the log-probs and versions they came with. ``more_carried`` (a call of carried samples): returns more
        carried samples (the same columns) that arrived meanwhile, or None; asked whenever a slot is free and,
        with ``True``, once more before the call ends (the caller must accept none after that). They join the
        call and come back after its own rows, in the order they arrived: a long-tail replica keeps its slots
        full while the other replicas hand their long samples over.

        ``meta`` reports occupancy: ``rollout/decode_steps``, ``rollout/slot_steps`` (the slots those steps
        advanced) and ``rollout/slots`` (``max_batch_size``: a full step); with ``sessions`` also
        ``rollout/riding_steps`` (decode steps that prefilled observations in their forward: eager ones, where the
        plain step is compiled or graphed) and ``rollout/extends`` (observations prefilled in a forward of their own).
        """
        params = sampling or SamplingParams()
        if self.cache is None or self._missing:
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
            if self.routes is not None:
                raise ValueError("NativeEngine(record_routes=True) records single-turn generation only, not agent "
                                 "sessions")
        carried = carried_samples(prompts, params)
        if (carried is not None or release_below) and (sessions is not None or self.routes is not None):
            raise ValueError("NativeEngine: repack (release_below, carried samples) is single-turn generation without "
                             "record_routes")
        if more_carried is not None and carried is None:
            raise ValueError("NativeEngine.generate: more_carried joins a call of carried samples (n 1), not fresh "
                             "prompts")
        joined: list[Batch] = []

        def more(final: bool) -> tuple[list[list[int]], list[int], list[int], list[CarriedSample]] | None:
            rows = more_carried(final)
            if rows is None or not len(rows):
                return None
            validate_prompts(rows, params, self.max_seq_len)
            samples = carried_samples(rows, params)
            joined.append(rows.select(*[k for k in rows.keys() if k not in CARRIED_COLUMNS]))
            return ([t.tolist() + c.tokens.tolist() for t, c in zip(prompt_token_lists(rows), samples)],
                    [m - len(c.tokens) for m, c in zip(prompt_max_tokens(rows, params), samples)],
                    prompt_seeds(rows, params), samples)

        prompt_tokens = prompt_token_lists(prompts)
        limits = prompt_max_tokens(prompts, params)
        if carried is not None:  # the context is the prompt and what it sampled so far; the budget what is left
            prompt_tokens = [torch.cat([t, c.tokens]) for t, c in zip(prompt_tokens, carried)]
            limits = [m - len(c.tokens) for m, c in zip(limits, carried)]
            prompts = prompts.select(*[k for k in prompts.keys() if k not in CARRIED_COLUMNS])
        if self.prepacked is not None:
            self.prepacked.refresh()
        if sessions is None:
            policy = SingleTurn(prompt_tokens, limits, params.n)
        else:
            if len(sessions) != len(prompt_tokens) * params.n:
                raise ValueError(f"generate: {len(sessions)} agent sessions for {len(prompt_tokens) * params.n} samples")
            policy = AgentTurns(sessions)
        run = Scheduler(self.decoder, self.decode_fn(), self.cache, params, policy,
                        prompt_seeds(prompts, params, self.tp_mesh), stop_ids=self.stop_ids(params),
                        check_every=self.check_every, min_span=self.min_decode_span, tokenizer=self.tokenizer,
                        use_prefix_cache=self.prefix_cache, between_steps=between_steps,
                        refresh_packed=self.prepacked.refresh if self.prepacked is not None else None, routes=self.routes,
                        repack=Repack(carried, (release_below or 0.0) * self.max_batch_size,
                                      more if more_carried is not None else None))
        in_fresh_stack_chunk(run.run)  # a hot loop: no Python stack-chunk boundary inside it
        res = run.results
        occupancy = {"rollout/decode_steps": float(run.decode_steps), "rollout/slot_steps": float(run.slot_steps),
                     "rollout/slots": float(self.max_batch_size)}
        versions = res.versions if between_steps is not None else None
        if sessions is not None:
            out = assemble_trajectories(prompts, params, [s.result() for s in sessions], res.log_probs, self.pad_id(),
                                        versions)
            out.meta.update(occupancy, **{"rollout/riding_steps": float(run.riding_steps),
                                          "rollout/extends": float(run.extends)})
            return out
        if joined:
            prompts = concat_generations([prompts, *joined], self.pad_id())
        out = assemble_generation(prompts, params, res.tokens, res.log_probs, res.lengths, res.reasons, self.pad_id())
        out.meta.update(occupancy)
        if versions is not None:
            out["token_weight_versions"] = (versions * out["response_mask"].cpu()).to(out["responses"].device)
        if res.routes is not None:
            out["routed_experts"] = res.routes.to(out["responses"].device)
        return out
