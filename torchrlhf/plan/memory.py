"""Memory of a role's micro-batch at any size, from a few traces of the model.

The dry run traces one micro-batch on fake tensors (`torchrlhf.trainer.memory`): exact, but seconds per trace, and a
planner asks for many micro-batch sizes. At each moment of the step the bytes held are linear in the micro-batch's
rows ``m`` (a layer's activations grow with ``m``, the weights, gradients and optimizer states do not), so the peak,
the largest of those lines, is convex in ``m``: flat while a moment with few activations alive sets it (the
embedding's gradient being built, the optimizer step), then rising once the activations outweigh that. Where it
turns depends on the model and the lengths: on a tiny model with SmolLM2's vocabulary and 256-token prompts, 1, 2
and 4 rows peak alike and 16 rows 32 % higher, so a line through 2 and 4 rows (this module's first model) stayed
flat and let the planner keep micro-batches that do not fit. So ``m`` is traced at the powers of two around it,
``p ≤ m ≤ 2p`` (one trace at a power of two), and takes the chord between them,

    f(L, m) = f(L, p) + (m - p) (f(L, 2p) - f(L, p)) / p,

exact at the traced sizes and, the peak being convex, never below it in between. A deep model (`shallow_depths`)
is traced at two shallower depths ``a < b`` instead and extrapolated linearly in ``L``. Both depths are deep enough
that the blocks outweigh the embedding and the head: with fewer layers the embedding's optimizer states set the peak
at another moment of the step, and the kinds stop being linear.

The shared-prefix schedule (`trainer.memory.trace_shared_prefix_update`) costs a trace per part and micro-batch, and
its Python loop over the prompts makes each one slow; it is taken as the dense micro-batch holding as many tokens
(`_dense_rows`) plus the schedule's excess over that, traced once at a small part (`_shared_excess`).

The traces are cached per model, setting and size for the process, and on disk for the machine (`trace_cache`). Fake tensors cost per operation, not per byte,
and the head runs in the target device's tiles (`trainer.memory.trace_micro_batch`), so on a GPU a large micro-batch
traces about as fast as a small one (Qwen2.5-0.5B, 1024 tokens: 5 s at 1 row, 10 s at 64).
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchrlhf.plan.trace_cache import cached
from torchrlhf.trainer.memory import trace_micro_batch, trace_shared_prefix_update


def shallow_depths(layers: int, block_params: int, other_params: int) -> tuple[int, int] | None:
    """Two depths ``a < b < layers`` to trace instead of the whole model, ``a`` the shallowest whose blocks hold 4×
    the other parameters (embedding, head, norms); None when the model is not deeper than ``2a``."""
    per_layer = max(1, block_params // max(layers, 1))
    a = max(1, -(-4 * other_params // per_layer))
    return (a, 2 * a) if 2 * a < layers else None


@functools.lru_cache(maxsize=None)
def _at_depth(model_path: str, layers: int) -> str:
    """A directory with ``model_path``'s config.json at ``layers`` layers (the traces build on meta: no weights)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    config["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_only_layers"):  # per-layer lists some families keep
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    text = json.dumps(config, sort_keys=True)
    d = Path(tempfile.gettempdir()) / "torchrlhf_plan" / hashlib.sha1(text.encode()).hexdigest()[:16]
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(text)
    return str(d)


@functools.lru_cache(maxsize=None)
def _dense(model_path: str, kind: str, setting: tuple, rows: int) -> dict[str, float]:
    """One trace: a dense micro-batch of ``rows`` samples, a trained one beside its mini-batch's gradients (an upper
    bound for any number of micro-batches, exact from the second on)."""
    return cached(model_path, "dense", (kind, setting, rows),
                  lambda: trace_micro_batch(model_path, micro=rows, accumulating=kind in ("train", "value"),
                                            **_trace_kw(kind, setting)))


def _shared_excess(model_path: str, kind: str, setting: tuple, prompts: int, n: int, micro: int
                   ) -> dict[str, float]:
    """What the shared-prefix schedule holds beyond its dense equivalent (`_dense_rows`), by kind: traced at two
    prompts and two samples per suffix micro-batch, at four prompts, and at four samples per micro-batch (``n``
    samples per prompt, up to 8; fewer where the part has fewer), and extended along those lines to ``prompts`` and
    ``micro``. It is what the dense rows miss: the prompts' activations held through the suffix micro-batches while
    the dense rows peak at another moment, the embedding's gradient built twice (the suffixes', then the prompts'),
    the suffix head's temporaries. On SmolLM2's vocabulary with two tiny layers and 64-token prompts: the gradient's
    12 MiB from two prompts on, 0.7 MiB of activations per prompt; on Qwen2.5-0.5B nothing, the dense equivalent
    holding 9-65 % more at every part measured."""
    n = min(n, 8)
    a, b = min(prompts, 2), min(prompts, 4)
    m0, m1 = min(2, a * n), min(4, a * n)
    base = _excess_at(model_path, kind, setting, a, n, m0)
    lines = []
    if b > a:
        lines.append((_excess_at(model_path, kind, setting, b, n, m0), (prompts - a) / (b - a)))
    if m1 > m0:
        lines.append((_excess_at(model_path, kind, setting, a, n, m1), (micro - m0) / (m1 - m0)))
    kinds = {*base, *(k for f, _ in lines for k in f)}
    return {k: max(0.0, base.get(k, 0.0) + sum(t * (f.get(k, 0.0) - base.get(k, 0.0)) for f, t in lines))
            for k in kinds}


@functools.lru_cache(maxsize=None)
def _shared(model_path: str, kind: str, setting: tuple, prompts: int, n: int, micro: int) -> dict[str, float]:
    """One trace of the shared-prefix schedule itself: ``prompts`` prompts of ``n`` samples, suffix micro-batches
    of ``micro``."""
    shared = dict(cached(model_path, "shared", (kind, setting, prompts, n, micro),
                         lambda: trace_shared_prefix_update(model_path, prompts=prompts, n=n, micro=micro,
                                                            **_trace_kw(kind, setting))))
    shared.pop("offloaded", None)
    return shared


@functools.lru_cache(maxsize=None)
def _excess_at(model_path: str, kind: str, setting: tuple, prompts: int, n: int, micro: int) -> dict[str, float]:
    shared = _shared(model_path, kind, setting, prompts, n, micro)
    dense = _in_rows(functools.partial(_dense, model_path, kind, setting), _dense_rows(prompts, micro, *setting[0]))
    return {k: max(0.0, v - dense.get(k, 0.0)) for k, v in shared.items()}


KINDS = ("train", "value", "forward", "value_forward")  # traced with (train, value_head)


def _trace_kw(kind: str, setting: tuple) -> dict[str, Any]:
    (prompt_len, response_len), dtype, lora, activation_checkpointing, optim, use_kl_loss, device_type = setting
    return dict(dtype=dtype, prompt_len=prompt_len, response_len=response_len, train=kind in ("train", "value"),
                value_head=kind in ("value", "value_forward"), lora=lora, activation_checkpointing=activation_checkpointing,
                optim=dict(optim) if optim else None, use_kl_loss=use_kl_loss, device_type=device_type)


def _dense_rows(prompts: int, micro: int, prompt_len: int, response_len: int) -> int:
    """Dense rows of ``prompt_len + response_len`` tokens that hold a shared-prefix step's tokens: ``prompts``
    prompts alive through a suffix micro-batch of ``micro`` × (1 + ``response_len``) tokens, and at least the
    micro-batch's rows (its responses go through the head)."""
    return max(micro, -(-(prompts * prompt_len + micro * (1 + response_len)) // (prompt_len + response_len)))


def micro_batch_memory(model_path: str, *, kind: str, micro: int, prompt_len: int, response_len: int,
                       dtype: torch.dtype, lora: Any = None, activation_checkpointing: bool = False,
                       optim: dict | None = None, use_kl_loss: bool = False, shared: tuple[int, int] | None = None,
                       device_type: str = "cpu", depths: tuple[int, int] | None = None, layers: int = 0,
                       floor: bool = False, exact: bool = False) -> dict[str, float]:
    """Peak bytes by kind of one unsharded micro-batch of ``micro`` × (``prompt_len`` + ``response_len``) tokens
    through ``model_path``'s architecture, as `trace_micro_batch` would report it at the traced sizes and never
    less in between. ``kind``: ``"train"`` (an actor's forward, loss, backward and optimizer step), ``"value"``
    (the critic's), ``"forward"`` (a no-grad pass: a frozen model's, or an actor's old log-probs),
    ``"value_forward"`` (the critic's no-grad values). ``floor``: the trace at the power of two at or below the
    rows instead of the chord, a lower bound in one trace where the chord takes two, so a size whose floor
    does not fit is rejected without tracing the size above. ``exact``: with ``shared``, the schedule traced at
    this very part instead (`trace_shared_prefix_update`; a slow trace per part, what a written plan is checked
    with). ``shared`` = (prompts, n): the shared-prefix schedule
    instead (`trace_shared_prefix_update`: a rank's ``prompts`` prompts once, alive through suffix micro-batches
    of ``micro`` of their ``n`` samples each), as its dense equivalent plus the schedule's excess over it.
    ``device_type``: the head's tiles, as `trace_micro_batch`'s. ``depths`` (`shallow_depths`): trace at those
    two depths and extrapolate to ``layers``."""
    if kind not in KINDS:
        raise ValueError(f"micro_batch_memory: kind must be one of {KINDS}, got {kind!r}")
    if kind in ("forward", "value_forward"):  # a no-grad pass: no optimizer, loss or recomputation to trace, so an
        activation_checkpointing, optim, use_kl_loss = False, None, False  # actor's shares its reference's traces
    setting = ((prompt_len, response_len), dtype, lora, activation_checkpointing, tuple(sorted((optim or {}).items())),
               use_kl_loss, device_type)

    rows = _floor_rows if floor else _in_rows

    def at(path: str) -> dict[str, float]:
        if shared is None:
            return rows(functools.partial(_dense, path, kind, setting), micro)
        suffix = min(micro, shared[0] * shared[1])  # a suffix micro-batch holds at most every sample
        if exact:
            return _shared(path, kind, setting, *shared, suffix)
        dense = rows(functools.partial(_dense, path, kind, setting),
                     _dense_rows(shared[0], suffix, prompt_len, response_len))
        excess = _shared_excess(path, kind, setting, *shared, suffix)
        return {k: dense.get(k, 0.0) + excess.get(k, 0.0) for k in {*dense, *excess}}

    if depths is None:
        return at(model_path)
    (a, b) = depths
    fa, fb = at(_at_depth(model_path, a)), at(_at_depth(model_path, b))
    return {k: max(0.0, fa.get(k, 0.0) + (layers - a) * (fb.get(k, 0.0) - fa.get(k, 0.0)) / (b - a))
            for k in {*fa, *fb}}


def _in_rows(corner: Callable[[int], dict[str, float]], micro: int) -> dict[str, float]:
    """``micro`` rows on the chord between the traces at the powers of two around it (one trace at a power of
    two): exact there and, the peak being convex in the rows, never below it in between."""
    low = 1 << (max(micro, 1).bit_length() - 1)
    if micro == low:
        return dict(corner(micro))
    f_low, f_high = corner(low), corner(2 * low)
    return {k: f_low.get(k, 0.0) + (micro - low) * (f_high.get(k, 0.0) - f_low.get(k, 0.0)) / low
            for k in {*f_low, *f_high}}


def _floor_rows(corner: Callable[[int], dict[str, float]], micro: int) -> dict[str, float]:
    """The trace at the power of two at or below ``micro``: the chord's lower end, at most its value."""
    return dict(corner(1 << (max(micro, 1).bit_length() - 1)))


__all__ = ["KINDS", "micro_batch_memory", "shallow_depths"]
