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

exact at the traced sizes and, the peak being convex, never below it in between. A model of alike layers is traced
at two shallow depths instead of its own (`shallow_depths`: 2 and 4 layers) and deepened (`_deepen`): the optimizer
step along the line through the two, the passes from the deeper one's peak, growing per layer as the steepest of
the peak itself and each moment the blocks' output reaches the final norm (`trainer.memory.StepMemory`). A line
through the two peaks alone fell short where the embedding or the head sets a shallow model's peak; this never did,
on the models and passes tested (`tests/plan/test_micro_batch_memory.py`), and is exact where the blocks' activations
set it.

The shared-prefix schedule (`trainer.memory.trace_shared_prefix_update`) costs a trace per part and micro-batch, and
its Python loop over the prompts makes each one slow; it is taken as the dense micro-batch holding as many tokens
(`_dense_rows`) plus the schedule's excess over that, traced once at a small part (`_shared_excess`).

The traces are cached per model, setting and size for the process, and on disk for the machine (`trace_cache`).
Fake tensors cost per operation, not per byte, and the head runs in the target device's tiles (`trainer.memory.trace_micro_batch`), so on a GPU a large micro-batch
traces about as fast as a small one (Qwen2.5-0.5B, 1024 tokens: 5 s at 1 row, 10 s at 64).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from torchrlhf.plan.trace_cache import cached, plan_cache_root
from torchrlhf.trainer.memory import StepMemory, trace_micro_batch, trace_shared_prefix_update


SHALLOW_DEPTHS = (2, 4)


@functools.lru_cache(maxsize=None)
def shallow_depths(model_path: str, layers: int) -> tuple[int, int] | None:
    """`SHALLOW_DEPTHS`, the depths a model of ``layers`` alike layers is traced at instead of its own; None when it
    is not deeper, or its config makes some layers differ from others (attention types, dense layers among
    mixture-of-experts ones), so that a shallow copy's layers would not be a sample of the model's."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    if layers <= SHALLOW_DEPTHS[1] or len(set(config.get("layer_types") or [])) > 1 or config.get("mlp_only_layers"):
        return None
    if config.get("num_experts") and config.get("decoder_sparse_step", 1) > 1:
        return None
    return SHALLOW_DEPTHS


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


def _step_memory(kept: dict) -> StepMemory:
    """A kept trace as a `StepMemory`; TypeError or ValueError if the file holds anything else."""
    memory = StepMemory(**kept)
    parts = [memory.passes, memory.optimizer, *memory.block_outputs]
    if not all(isinstance(p, dict) and all(isinstance(b, (int, float)) for b in p.values()) for p in parts) \
            or not isinstance(memory.offloaded, (int, float)):
        raise ValueError(f"not a traced step: {kept!r}")
    return memory


def _cached(model_path: str, what: str, args: tuple, trace: Callable[[], StepMemory]) -> StepMemory:
    return cached(model_path, what, args, lambda: dataclasses.asdict(trace()), read=_step_memory)


@functools.lru_cache(maxsize=None)
def _dense(model_path: str, kind: str, setting: tuple, rows: int) -> StepMemory:
    """One trace: a dense micro-batch of ``rows`` samples, a trained one beside its mini-batch's gradients (an upper
    bound for any number of micro-batches, exact from the second on)."""
    return _cached(model_path, "dense", (kind, setting, rows),
                   lambda: trace_micro_batch(model_path, micro=rows, accumulating=kind in ("train", "value"),
                                             phases=True, **_trace_kw(kind, setting)))


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
def _shared(model_path: str, kind: str, setting: tuple, prompts: int, n: int, micro: int) -> StepMemory:
    """One trace of the shared-prefix schedule itself: ``prompts`` prompts of ``n`` samples, suffix micro-batches
    of ``micro``."""
    return _cached(model_path, "shared", (kind, setting, prompts, n, micro),
                   lambda: trace_shared_prefix_update(model_path, prompts=prompts, n=n, micro=micro, phases=True,
                                                      **_trace_kw(kind, setting)))


@functools.lru_cache(maxsize=None)
def _excess_at(model_path: str, kind: str, setting: tuple, prompts: int, n: int, micro: int) -> dict[str, float]:
    shared = _shared(model_path, kind, setting, prompts, n, micro).peak
    dense = _in_rows(functools.partial(_dense, model_path, kind, setting),
                     _dense_rows(prompts, micro, *setting[0])).peak
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
    two depths and deepen to ``layers`` (`_deepen`)."""
    setting = _setting(kind, prompt_len, response_len, dtype, lora, activation_checkpointing, optim, use_kl_loss,
                       device_type)
    return dict(_estimate(model_path, kind, setting, micro, shared, depths, layers, floor, exact))


def _setting(kind: str, prompt_len: int, response_len: int, dtype: torch.dtype, lora: Any,
             activation_checkpointing: bool, optim: dict | None, use_kl_loss: bool, device_type: str) -> tuple:
    """What a trace of ``kind`` depends on besides the model and the rows (a cache key's part)."""
    if kind not in KINDS:
        raise ValueError(f"micro_batch_memory: kind must be one of {KINDS}, got {kind!r}")
    if kind in ("forward", "value_forward"):  # a no-grad pass: no optimizer, loss or recomputation to trace, so an
        activation_checkpointing, optim, use_kl_loss = False, None, False  # actor's shares its reference's traces
    return ((prompt_len, response_len), dtype, lora, activation_checkpointing, tuple(sorted((optim or {}).items())),
            use_kl_loss, device_type)


def dense_traces(model_path: str, kinds: tuple[str, ...], max_rows: int, *, prompt_len: int, response_len: int,
                 dtype: torch.dtype, lora: Any = None, activation_checkpointing: bool = False,
                 optim: dict | None = None, use_kl_loss: bool = False, device_type: str = "cpu",
                 depths: tuple[int, int] | None = None) -> list[tuple]:
    """The dense traces (`_dense`'s arguments) that `micro_batch_memory` may take for micro-batches of up to
    ``max_rows`` rows of these ``kinds`` (``depths``: at the two shallow depths), fewest rows first: the powers of
    two up to the one above ``max_rows`` (the chord's upper end)."""
    paths = [_at_depth(model_path, d) for d in depths] if depths else [model_path]
    settings = [(kind, _setting(kind, prompt_len, response_len, dtype, lora, activation_checkpointing, optim,
                                use_kl_loss, device_type)) for kind in kinds]
    rows = [1 << j for j in range(max(max_rows, 1).bit_length() + 1)]
    return [(path, kind, setting, r) for r in rows for kind, setting in settings for path in paths]


def _trace_each(traces: list[tuple], environ: dict[str, str]) -> None:
    os.environ.clear()  # the planner's, as a spawned process would have it (a forkserver's dates from its start)
    os.environ.update(environ)
    torch.set_num_threads(1)
    for args in traces:
        _dense(*args)


@contextlib.contextmanager
def traced_ahead(traces: list[tuple]) -> Iterator[multiprocessing.process.BaseProcess | None]:
    """Trace ``traces`` (`dense_traces`) into the disk cache (`trace_cache`) in a process of its own while the
    block runs, in order; the block's own traces read them from the cache once written, and trace the others
    themselves (a trace both take is written twice, whole, with the same numbers). Why: a trace runs on one core
    (fake tensors dispatch in Python), and a plan waits on tens of them. Nothing runs without a disk cache; the
    process is stopped when the block ends. Yields the process (None without a cache)."""
    if plan_cache_root() is None or not traces:
        yield None
        return
    # forkserver where there is one: a process that plans again (a test, a notebook) forks its tracer from a
    # server that has imported torch already, instead of paying the imports at every plan as spawn would
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    process = multiprocessing.get_context(method).Process(target=_trace_each, args=(traces, dict(os.environ)),
                                                          daemon=True)
    process.start()
    try:
        yield process
    finally:
        if process.is_alive():
            process.terminate()
        process.join()


@functools.lru_cache(maxsize=None)
def _estimate(model_path: str, kind: str, setting: tuple, micro: int, shared: tuple[int, int] | None,
              depths: tuple[int, int] | None, layers: int, floor: bool, exact: bool) -> dict[str, float]:
    """`micro_batch_memory`, kept per argument: a search asks for the same sizes of each role again and again."""
    (prompt_len, response_len) = setting[0]
    rows = _floor_rows if floor else _in_rows
    suffix = min(micro, shared[0] * shared[1]) if shared else micro  # a suffix micro-batch holds at most every sample

    def dense(path: str, n_rows: int) -> StepMemory:
        return rows(functools.partial(_dense, path, kind, setting), n_rows)

    if shared is None or exact:  # one traced step: the dense micro-batch, or the schedule at this very part
        def step(path: str) -> StepMemory:
            return dense(path, micro) if shared is None else _shared(path, kind, setting, *shared, suffix)

        if depths is None:
            return step(model_path).peak
        return _deepen(*(step(_at_depth(model_path, d)) for d in depths), *depths, layers)

    # the search's estimate of the schedule: its dense equivalent plus the schedule's excess over it
    n_rows = _dense_rows(shared[0], suffix, prompt_len, response_len)
    if depths is None:
        equivalent = dense(model_path, n_rows).peak
        excess = _shared_excess(model_path, kind, setting, *shared, suffix)
    else:
        paths = [_at_depth(model_path, d) for d in depths]
        equivalent = _deepen(*(dense(p, n_rows) for p in paths), *depths, layers)
        excess = _line(*(_shared_excess(p, kind, setting, *shared, suffix) for p in paths),
                       (layers - depths[0]) / (depths[1] - depths[0]))
    return {k: equivalent.get(k, 0.0) + max(0.0, excess.get(k, 0.0)) for k in {*equivalent, *excess}}


def _total(f: dict[str, float]) -> float:
    return sum(f.values())


def _line(f0: dict[str, float], f1: dict[str, float], t: float) -> dict[str, float]:
    """``f0 + t (f1 - f0)``, by kind."""
    return {k: f0.get(k, 0.0) + t * (f1.get(k, 0.0) - f0.get(k, 0.0)) for k in {*f0, *f1}}


def _deepen(fa: StepMemory, fb: StepMemory, a: int, b: int, layers: int) -> dict[str, float]:
    """The peak by kind of a step through ``layers`` layers from its traces at depths ``a < b``. The optimizer step
    holds the same per parameter at any depth, so its peak is on the line through the two. Each moment of the passes
    holds bytes on a line in the depth, and the passes' peak is the largest of them: ``b``'s peak plus, for each
    further layer, the steepest growth among the peak's own and each moment the blocks' output reaches the final
    norm (`StepMemory.block_outputs`: every block's saved activations, or keys and values, alive). A line through
    two shallow peaks alone can fall short: where the embedding's or the head's temporaries set the peak at depth
    ``b``, it grows by a layer's weights only, while a deeper model's peak is set by the blocks' activations and
    grows by those too (a 12-layer model with SmolLM2's vocabulary, 8 rows of 264 tokens: 0.87x from depths 1 and
    2; with activation checkpointing 0.97x from depths 2 and 4). The largest of the marked moments alone fell short
    too: Llama-2 7B's no-grad pass over 256 prompts of 1 024 tokens, suffix micro-batches of 64, is set at 2, 4
    and 8 layers by one moment and at 32 by a steeper one (0.98x)."""
    lines = [(fa.passes, fb.passes), *zip(fa.block_outputs, fb.block_outputs)]
    low, high = max(lines, key=lambda line: _total(line[1]) - _total(line[0]))
    passes = {k: fb.passes.get(k, 0.0) + (layers - b) / (b - a) * (high.get(k, 0.0) - low.get(k, 0.0))
              for k in {*fb.passes, *low, *high}}
    optimizer = _line(fa.optimizer, fb.optimizer, (layers - a) / (b - a))
    return {k: max(0.0, v) for k, v in max(passes, optimizer, key=_total).items()}


def _in_rows(corner: Callable[[int], StepMemory], micro: int) -> StepMemory:
    """``micro`` rows on the chord between the traces at the powers of two around it (one trace at a power of
    two): exact there and, the peak being convex in the rows, never below it in between."""
    low = 1 << (max(micro, 1).bit_length() - 1)
    if micro == low:
        return corner(micro)
    f_low, f_high, t = corner(low), corner(2 * low), (micro - low) / low
    return StepMemory(passes=_line(f_low.passes, f_high.passes, t),
                      optimizer=_line(f_low.optimizer, f_high.optimizer, t),
                      block_outputs=[_line(lo, hi, t) for lo, hi in zip(f_low.block_outputs, f_high.block_outputs)])


def _floor_rows(corner: Callable[[int], StepMemory], micro: int) -> StepMemory:
    """The trace at the power of two at or below ``micro``: the chord's lower end, at most its value."""
    return corner(1 << (max(micro, 1).bit_length() - 1))


__all__ = ["KINDS", "SHALLOW_DEPTHS", "dense_traces", "micro_batch_memory", "shallow_depths", "traced_ahead"]
