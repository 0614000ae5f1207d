"""vLLM as a rollout engine, driven from the rollout worker's process.

With one rank (or ``in_process=True``) vLLM's engine core runs in the caller's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): `VLLMEngine.update_weights` hands tensors to vLLM's in-place
reload as one stream, without pickling or disk. Under ``torch.distributed`` with several ranks the engine
core runs in a child process with a world of its own (in-process vLLM would form its groups over our
whole world), and weights go to it in buckets of whole modules. vLLM is imported only when an engine is
built, so ``torchrlhf.generation`` works without it.

Side effects of an in-process engine on the process (vLLM's, not ours; see `VLLMEngine`): vLLM initialises
``torch.distributed`` (a 1-rank gloo group) when nobody has, on CPU it pins the OpenMP threads and turns
``torch.set_num_threads`` into a no-op, and its teardown (`VLLMEngine.shutdown`, or garbage collection
of the engine) destroys the default process group, whoever created it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load as load_safetensors, save as save_safetensors
from transformers import AutoConfig, GenerationConfig

from torchrlhf.data.batch import Batch
from torchrlhf.generation.base import (
    RESUME_TAGS,
    assemble_generation,
    check_resume_tags,
    generate_in_rounds,
    prompt_max_tokens,
    prompt_seeds,
    prompt_token_lists,
    validate_prompts,
)
from torchrlhf.generation.sampling import SamplingParams, sample_seed
from torchrlhf.generation.session import Session
from torchrlhf.models.moe import stacked_expert_sources

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
VLLM_TEMPERATURE_RANGE = (1e-2, 2.0)  # vLLM clamps smaller temperatures up and rejects larger ones


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vLLM imports here, else (False, why)."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return False, f"{type(e).__name__}: {e}"
    return True, vllm.__version__


def _checkpoint_shapes(path: Path) -> dict[str, torch.Size]:
    """HF name -> shape of every tensor of the safetensors checkpoint in ``path`` (headers only)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} holds no *.safetensors checkpoint; VLLMEngine starts from an HF model directory")
    shapes = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = torch.Size(f.get_slice(name).get_shape())
    return shapes


_LAUNCH_ENV = ("LD_PRELOAD", "LOCAL_WORLD_SIZE")


@contextmanager
def _keep_caller_state(cuda: bool) -> Iterator[None]:
    """Restore what vLLM's start changes for its own process: the global RNGs, torch.set_num_threads (which
    it replaces with a no-op), the thread count (which it lowers "for serving": training would slow down)
    and the launch variables it rewrites (`_LAUNCH_ENV`: its CPU platform sets LD_PRELOAD for its own
    children and LOCAL_WORLD_SIZE to its TP size, which torchrun set for this rank)."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    launch_env = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    try:
        with torch.random.fork_rng(devices=[0] if cuda else []):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        for key, value in launch_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _exit_with(worker, pid: int) -> None:
    """Run on vLLM's worker process: end its engine core and itself once process ``pid`` is gone.

    vLLM's child processes outlive a parent that dies abruptly (SIGKILL, os._exit, torchrun's SIGTERM);
    this keeps a dead rollout rank from leaving its engine running.
    """

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os.kill(os.getppid(), signal.SIGKILL)  # the engine core
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="torchrlhf-exit-with-parent").start()


@contextmanager
def _multiprocessing(enabled: bool) -> Iterator[None]:
    """vLLM's engine core in a child process (enabled) or in this one, whatever the environment says.

    A child process gets our reload / repack functions over vLLM's local IPC sockets, which needs vLLM's
    pickle fallback (``VLLM_ALLOW_INSECURE_SERIALIZATION``): the peers are this process and its own child.
    """
    before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if enabled else "0"
    if enabled:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before


def _repack_tied_lm_head(worker) -> None:
    """Run on vLLM's worker: rebuild the tied lm_head's CPU GEMM from the (reloaded) embedding.

    On CPU vLLM multiplies by a packed copy of the lm_head weight, made after loading; reload_weights
    repacks the modules it loads, but a tied lm_head is never loaded (it shares the embedding), so
    without this its logits keep coming from the old embedding.
    """
    head = worker.get_model().lm_head
    head.quant_method.process_weights_after_loading(head)


def _repack_experts(worker, names: list[str]) -> None:
    """Run on vLLM's worker: rebuild the CPU grouped-GEMM copy of the reloaded experts of the MoE modules
    ``names`` (vLLM's module names, e.g. ``model.layers.0.mlp.experts``).

    On CPU vLLM prepacks each MoE layer's expert weights into its grouped-GEMM layout once, at the first load;
    ``reload_weights`` processes a weight update but skips that prepack, so without this the layer keeps
    multiplying by the old experts.
    """
    model = worker.get_model()
    for name in names:
        for layer in model.get_submodule(name).modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            if kernel is not None and hasattr(layer, "w13_weight"):
                kernel.fused_experts.process_weights_after_loading(layer)


def _reload_bucket(worker, packed: bytes) -> None:
    """Run on vLLM's worker process: reload one bucket of whole modules (safetensors bytes) in place."""
    worker.reload_weights(weights_iterator=iter(load_safetensors(packed).items()))


def _packed_modules(worker) -> dict[str, list[str]]:
    """Run on vLLM's worker (`LLM.collective_rpc`): fused module -> the HF modules it holds (qkv_proj: q/k/v)."""
    return {k: list(v) for k, v in getattr(worker.get_model(), "packed_modules_mapping", {}).items()}


class VLLMEngine:
    """Generation with vLLM (V1 engine, in-process) behind the `RolloutEngine` interface.

    Same output contract, seeds and weight contract as `NativeEngine`; the differences:

    * ``rollout_log_probs`` come from vLLM's ``logprobs_mode="processed_logprobs"``: log_softmax of
      the logits after temperature *and* after top-k / top-p / min-p masking. Without those filters
      (``top_k=-1, top_p=1, min_p=0``: the usual RL setting) that is exactly our definition,
      log_softmax(logits / T) (T = 1 when greedy). With a filter on, vLLM renormalises over the kept
      tokens: each log-prob is ours minus log(kept probability mass), i.e. too high. No vLLM mode
      gives ours then (``raw_logprobs``, taken before the temperature, would be exact only at T = 1).
    * sampling uses vLLM's own sampler (per-request generators seeded from ``(seed_i, j)``, see
      `sample_seed`): reproducible and independent of batch composition, but different draws
      from `NativeEngine` for the same seed. Temperatures must be 0 or in [0.01, 2] (vLLM's range).
    * TP: only ``tp_mesh=None`` (or of size 1). vLLM builds its own TP groups over the *whole*
      ``torch.distributed`` world as blocks of adjacent ranks, collectively; the hybrid layout's TP
      groups are strided (`torchrlhf.hybrid.layout`) and split placement leaves the actor's ranks out.
    * in-process under ``torch.distributed`` with more than one rank, vLLM creates its groups over
      the whole world even at TP=1, so every rank would have to build its engine at the same time (an
      engine on a subset of the ranks, as in split placement, hangs in its constructor). So with more
      than one rank the engine runs vLLM's engine core in a process of its own (``in_process=None``,
      the default), which has its own one-rank world; weights then travel to it in buckets of whole
      vLLM modules (``bucket_mb``), serialised by vLLM, instead of as one in-process stream.
    * `release`/`resume` free and restore memory only with ``enable_sleep_mode`` on CUDA (vLLM's
      sleep level 2, then ``wake_up`` weights before KV cache). vLLM has no sleep mode on CPU: there
      both are no-ops and vLLM keeps its weights and KV cache while training runs.

    Args:
        model_path: HF model directory (config, safetensors and, for stop strings, a tokenizer).
        tokenizer: kept as `self.tokenizer` (its EOS id ends samples; default: the one vLLM loads).
            vLLM loads the tokenizer files of ``model_path``; without any it runs tokenizer-less:
            EOS still comes from the generation config, stop strings are refused.
        max_batch_size: sequences vLLM decodes together (``max_num_seqs``).
        max_seq_len: longest prompt + response (``max_model_len``).
        device: where vLLM runs: its build's platform decides (checked), and in-process on CUDA
            it always takes ``cuda:0`` (so give each process its GPU with ``CUDA_VISIBLE_DEVICES``).
        dtype: weights and KV cache; default float32 on CPU, the checkpoint's dtype elsewhere.
        tp_mesh: must be None or of size 1 (see above).
        kv_cache_gib: KV-cache size in GiB on CPU (on CUDA ``gpu_memory_utilization`` sizes it).
        gpu_memory_utilization: fraction of GPU memory vLLM may use for weights, activations and
            KV cache (CUDA only).
        enforce_eager: run the model eagerly (no torch.compile, no CUDA graphs): faster start.
        enable_prefix_caching: reuse the KV of shared prompt prefixes (the n samples of a prompt).
        enable_sleep_mode: let `release` free the weights and KV cache (CUDA only).
        seed: vLLM's engine seed (every request carries its own seed; this covers the rest).
        in_process: run vLLM's engine core in this process (True) or in a child process (False);
            None: in-process unless ``torch.distributed`` has more than one rank (see above).
        bucket_mb: with the engine core in a child process, the most MiB of weights per transfer.
    """

    capabilities = frozenset({"agent_sessions"})  # in rounds; no partial rollouts (no hook between decode steps)

    def __init__(
        self,
        model_path: str | Path,
        tokenizer=None,
        *,
        max_batch_size: int = 64,
        max_seq_len: int = 2048,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        tp_mesh=None,
        kv_cache_gib: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = True,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        in_process: bool | None = None,
        bucket_mb: int = 64,
    ) -> None:
        if tp_mesh is not None and tp_mesh.size() > 1:
            raise ValueError(
                f"VLLMEngine supports tp_mesh=None only (got TP size {tp_mesh.size()}): in-process vLLM forms "
                "its TP groups itself, as blocks of adjacent ranks of the whole torch.distributed world, and "
                "every world rank must build an engine at the same time; torchrlhf's generation TP groups are "
                "strided (hybrid.layout) or leave ranks out (split placement). Use NativeEngine for TP."
            )
        if max_batch_size < 1 or max_seq_len < 2:
            raise ValueError(f"need max_batch_size >= 1 and max_seq_len >= 2, got {max_batch_size}, {max_seq_len}")
        if in_process is None:
            in_process = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
        self.in_process, self.bucket_bytes = in_process, bucket_mb << 20
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines would drown the run's own log
        from vllm import LLM
        from vllm.platforms import current_platform

        path = Path(model_path)
        self.device = torch.device(device)
        if self.device.type != current_platform.device_type or (self.device.index or 0) != 0:
            raise ValueError(
                f"VLLMEngine: device={self.device}, but this vLLM build runs on {current_platform.device_type!r}, "
                "and in-process on device index 0 only (set CUDA_VISIBLE_DEVICES to give a process its GPU)"
            )
        self.model_path, self.tp_mesh, self.tp_size = path, None, 1
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        # A mixture-of-experts checkpoint holds a tensor per expert and projection; the training model (and so
        # `update_weights`) names them stacked, as transformers does (`models.moe.stacked_expert_sources`).
        per_expert = _checkpoint_shapes(path)
        self._stacked = stacked_expert_sources(per_expert)
        self._shapes = {n: s for n, s in per_expert.items()
                        if not any(n in parts for sources in self._stacked.values() for parts in sources)}
        self._part_rows = {part: per_expert[part][0] for sources in self._stacked.values()
                           for parts in sources for part in parts}
        for name, sources in self._stacked.items():
            rows = sum(per_expert[part][0] for part in sources[0])
            self._shapes[name] = torch.Size([len(sources), rows, *per_expert[sources[0][0]][1:]])
        config = AutoConfig.from_pretrained(str(path))
        try:
            gen_config = GenerationConfig.from_pretrained(str(path))
        except OSError:
            gen_config = GenerationConfig.from_model_config(config)
        self._tied = bool(getattr(config, "tie_word_embeddings", False))
        if self._tied:  # one tensor, named as the embedding (vLLM skips a tied lm_head.weight)
            self._shapes.pop("lm_head.weight", None)

        has_tokenizer = any((path / f).is_file() for f in TOKENIZER_FILES)
        on_cpu = self.device.type == "cpu"
        self._sleep = enable_sleep_mode and self.device.type == "cuda"
        with _keep_caller_state(cuda=not on_cpu), _multiprocessing(not in_process):
            self.llm = LLM(
                str(path),
                skip_tokenizer_init=not has_tokenizer,
                dtype=dtype or (torch.float32 if on_cpu else "auto"),
                seed=seed,
                max_model_len=max_seq_len,
                max_num_seqs=max_batch_size,
                enforce_eager=enforce_eager,
                enable_prefix_caching=enable_prefix_caching,
                enable_sleep_mode=self._sleep,
                kv_cache_memory_bytes=int(kv_cache_gib * 2**30) if on_cpu else None,
                gpu_memory_utilization=gpu_memory_utilization,
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # sampling and EOS come from our SamplingParams only
            )
        if not in_process:
            self.llm.collective_rpc(_exit_with, args=(os.getpid(),))
        self.dtype = self.llm.llm_engine.model_config.dtype
        if tokenizer is None and has_tokenizer:
            tokenizer = self.llm.get_tokenizer()
        self.tokenizer = tokenizer
        self._has_vllm_tokenizer = has_tokenizer

        eos = [gen_config.eos_token_id, getattr(tokenizer, "eos_token_id", None)]
        self._eos_ids = sorted({i for e in eos for i in (e if isinstance(e, (list, tuple)) else [e]) if i is not None})
        pads = [getattr(s, "pad_token_id", None) for s in (tokenizer, gen_config, config)]
        self._pad_id = next((int(p) for p in pads if p is not None), self._eos_ids[0] if self._eos_ids else 0)
        self._modules = self._module_members(self.llm.collective_rpc(_packed_modules)[0])
        self._asleep: set[str] = set()
        self._missing: set[str] = set()

    # ------------------------------------------------------------------ weights
    def param_names(self) -> list[str]:
        """HF names `update_weights` accepts (those of the checkpoint; a tied lm_head is the embedding)."""
        return list(self._shapes)

    def param_shard_dims(self) -> dict[str, int | None]:
        """Name -> TP dim: all None (TP=1 takes full tensors)."""
        return dict.fromkeys(self._shapes)

    def param_local_shapes(self) -> dict[str, torch.Size]:
        """Name -> the shape `update_weights` expects (the full tensor's)."""
        return dict(self._shapes)

    def load_groups(self) -> list[set[str]]:
        """Names `update_weights` must receive together (vLLM's fused modules: q/k/v, gate/up)."""
        return [set(names) for names in self._modules.values() if len(names) > 1]

    def _module_members(self, packed: dict[str, list[str]]) -> dict[str, set[str]]:
        """vLLM module -> the HF names it loads (q/k/v_proj.* -> qkv_proj): loaded together or not at all."""
        fused = {part: name for name, parts in packed.items() for part in parts}
        members: dict[str, set[str]] = {}
        for name in self._shapes:
            module = name.rpartition(".")[0]
            parent, _, leaf = module.rpartition(".")
            members.setdefault(f"{parent}.{fused[leaf]}" if leaf in fused else module, set()).add(name)
        return members

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``(hf_name, full_tensor)`` pairs into vLLM's weights in place, streaming.

        The pairs go through one call of vLLM's in-place ``reload_weights``, which processes each
        vLLM module as soon as all its tensors have arrived (a fused ``qkv_proj`` waits for q, k
        and v), so memory holds at most the modules still incomplete, never the whole model. Each
        tensor is copied (in the engine's dtype) before the next is taken. A partial set is fine
        at module granularity: modules not sent keep their weights. A module sent in part would be
        left half undefined, so that raises, as do unknown names and shape mismatches (the pairs
        before the bad one are loaded and the engine stays usable). The prefix cache is cleared.
        """
        loaded: set[str] = set()
        failure: list[Exception] = []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            try:
                for name, tensor in named_tensors:
                    if name == "lm_head.weight" and self._tied:
                        name = "model.embed_tokens.weight"
                    shape = self._shapes.get(name)
                    if shape is None:
                        raise ValueError(f"update_weights: unknown parameter {name!r} (see VLLMEngine.param_names())")
                    if tuple(tensor.shape) != tuple(shape):
                        raise ValueError(
                            f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}"
                        )
                    loaded.add(name)
                    yield name, tensor.to(self.device, self.dtype, copy=True)
            except Exception as e:  # noqa: BLE001 - end the stream so vLLM finishes its reload, then re-raise
                failure.append(e)

        if self.in_process:
            pairs = (pair for name, tensor in stream() for pair in self._checkpoint_pairs(name, tensor))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs})
        else:
            for names, tensors in self._module_buckets(stream()):
                bucket = dict(pair for name, tensor in zip(names, tensors)
                              for pair in self._checkpoint_pairs(name, tensor))
                self.llm.collective_rpc(_reload_bucket, args=(save_safetensors(bucket),))
        if self._tied and self.device.type == "cpu" and "model.embed_tokens.weight" in loaded:
            self.llm.collective_rpc(_repack_tied_lm_head)
        experts = sorted({name.rpartition(".")[0] for name in loaded & set(self._stacked)})
        if experts and self.device.type == "cpu":
            self.llm.collective_rpc(_repack_experts, args=(experts,))
        self.llm.reset_prefix_cache()
        self._missing -= loaded
        if failure:
            raise failure[0]
        partial = {m: sorted(names - loaded) for m, names in self._modules.items() if names & loaded and names - loaded}
        if partial:
            module, absent = next(iter(partial.items()))
            raise ValueError(
                f"update_weights: vLLM loads {module!r} as one module, but {absent} did not come with the rest "
                f"of it, so that module's weights are now undefined; send all of its parameters in one call"
            )

    def _checkpoint_pairs(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` as vLLM loads it: a stacked expert weight as its checkpoint's per-expert tensors
        (views of it, each expert's rows split in the checkpoint's order: gate then up)."""
        sources = self._stacked.get(name)
        if sources is None:
            yield name, tensor
            return
        for expert, parts in enumerate(sources):
            rows = [self._part_rows[part] for part in parts]
            yield from zip(parts, tensor[expert].split(rows))

    def _module_buckets(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[list, list]]:
        """(names, tensors) buckets of at most ``bucket_bytes`` that end only where no vLLM module is half sent.

        vLLM loads a fused module (qkv_proj) from q, k and v together; a bucket that split them would
        leave it half defined between two reloads.
        """
        owner = {name: module for module, names in self._modules.items() for name in names}
        names: list[str] = []
        tensors: list[torch.Tensor] = []
        open_modules: dict[str, set[str]] = {}
        size = 0
        for name, tensor in pairs:
            names.append(name)
            tensors.append(tensor)
            size += tensor.numel() * tensor.element_size()
            module = owner[name]
            pending = open_modules.setdefault(module, set(self._modules[module]))
            pending.discard(name)
            if not pending:
                del open_modules[module]
            if size >= self.bucket_bytes and not open_modules:
                yield names, tensors
                names, tensors, size = [], [], 0
        if names:
            yield names, tensors

    # ------------------------------------------------------------------ memory
    def release(self) -> None:
        """Free the weights and KV cache (vLLM sleep level 2) with sleep mode on CUDA; else a no-op.

        After `resume`, the weights must be refilled with `update_weights` before `generate`.
        """
        if not self._sleep or self._asleep:
            return
        self.llm.sleep(level=2)
        self._asleep = set(RESUME_TAGS)
        self._missing = set(self._shapes)

    def resume(self, tags: Sequence[str] = RESUME_TAGS) -> None:
        """Re-allocate what `release` freed: ``"weights"`` (undefined until `update_weights`), ``"kv_cache"``."""
        tags = check_resume_tags(tags)
        for tag in RESUME_TAGS:  # weights first, whatever order the tags came in
            if tag in tags and tag in self._asleep:
                self.llm.wake_up(tags=[tag])
                self._asleep.discard(tag)

    def shutdown(self) -> None:
        """Stop vLLM's engine now (also what garbage collection of the engine does).

        vLLM's teardown destroys torch.distributed's default process group, even one it did not create.

        vLLM 0.32 force-kills an engine process that outlives its grace period by naming each of its children
        first (psutil), and a child that exits in between raises ``NoSuchProcess`` out of the whole shutdown (it
        failed a CI run at the end of a finished job). What it was about to kill is gone, so the shutdown is
        run again for the rest.
        """
        import psutil  # a vLLM dependency

        for attempt in range(3):
            try:
                self.llm.llm_engine.engine_core.shutdown()
                return
            except psutil.NoSuchProcess:
                if attempt == 2:
                    raise

    # ------------------------------------------------------------------ generate
    def _request_params(self, params: SamplingParams) -> dict:
        """vLLM SamplingParams fields for one sample of ``params`` (n=1: each sample has its own seed)."""
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self._eos_ids))
        return dict(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=max(params.top_k, 0),  # ours: -1 or 0 is off; vLLM's: 0
            min_p=params.min_p,
            max_tokens=params.max_tokens,
            stop_token_ids=sorted(stop_ids),
            stop=list(params.stop),
            ignore_eos=params.ignore_eos,
            logprobs=0 if params.logprobs else None,  # the sampled token's only
            flat_logprobs=True,
            detokenize=bool(params.stop),  # text is needed only to find stop strings
            skip_special_tokens=False,  # as NativeEngine decodes for stop strings
        )

    def generate(self, prompts: Batch, sampling: SamplingParams | None = None, *,
                 sessions: Sequence[Session] | None = None) -> Batch:
        """Sample ``sampling.n`` responses per left-padded prompt: the columns of `assemble_generation`.

        The stop token (EOS or ``stop_token_ids``) ends the response and is kept in it; on a stop
        string the response ends with the token that completed it. Both report ``"stop"``.

        ``sessions`` (agents, one per sample): multi-turn trajectories (`assemble_trajectories`' columns).
        Turns go in rounds (`generate_in_rounds`): every trajectory that can generate gets a request with its
        whole token sequence (vLLM's prefix cache holds what earlier turns computed, so only the new tokens
        are prefilled), then the sessions run their tools and environments, together, before the next round.
        """
        from vllm import SamplingParams as VLLMSamplingParams

        params = sampling or SamplingParams()
        if sessions is not None:
            return generate_in_rounds(self.generate, prompts, params, sessions, self._pad_id)
        if self._asleep or self._missing:
            raise RuntimeError("VLLMEngine.generate after release(): call resume() and update_weights() first")
        if params.stop and not self._has_vllm_tokenizer:
            raise ValueError(f"SamplingParams.stop needs a tokenizer: vLLM found none in {self.model_path}")
        low, high = VLLM_TEMPERATURE_RANGE
        if params.temperature and not low <= params.temperature <= high:
            raise ValueError(f"VLLMEngine: temperature must be 0 or in [{low}, {high}], got {params.temperature}")
        validate_prompts(prompts, params, self.max_seq_len)
        seeds = prompt_seeds(prompts, params)
        fields = self._request_params(params)
        limits = prompt_max_tokens(prompts, params)
        requests, request_params = [], []
        for i, tokens in enumerate(prompt_token_lists(prompts)):
            ids = tokens.tolist()
            for j in range(params.n):
                requests.append({"prompt_token_ids": ids})
                seed = None if params.greedy else sample_seed(seeds[i], j)
                request_params.append(VLLMSamplingParams(**{**fields, "max_tokens": limits[i]}, seed=seed))
        outputs = self.llm.generate(requests, request_params, use_tqdm=False) if requests else []

        total, width = len(requests), params.max_tokens
        tokens = torch.zeros(total, width, dtype=torch.long)
        logps = torch.zeros(total, width, dtype=torch.float32)
        resp_len = torch.zeros(total, dtype=torch.long)
        reasons = []
        for k, out in enumerate(outputs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            tokens[k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            if params.logprobs:
                logps[k, : len(ids)] = torch.tensor(sample.logprobs.logprobs, dtype=torch.float32)
            resp_len[k] = len(ids)
            reasons.append("stop" if sample.finish_reason == "stop" else "length")
        return assemble_generation(prompts, params, tokens, logps, resp_len, reasons, self._pad_id)
