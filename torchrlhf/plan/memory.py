"""Memory of a role's micro-batch at any size, from a few traces of the model.

The dry run traces one micro-batch on fake tensors (`torchrlhf.trainer.memory`): exact, but seconds to minutes per
trace, and a planner asks for many micro-batch sizes. Where the peak falls at the same moment of the step whatever
the size (the end of the forward, or in backward), each kind the trace reports is linear in the micro-batch's rows
``m`` and in the layers ``L``: parameters, gradients and optimizer states grow with ``L``; a layer's activations
with ``L · m``; the head's and the loss's with ``m``. One row can peak elsewhere: in the optimizer step, with every
gradient alive, when a row's activations weigh less than the gradients. So the model is traced at 1, 2 and 4 rows:
``m = 1`` is its own trace, and a larger ``m`` takes the larger of the line through 2 and 4 rows,

    f(L, m) = f(L, 2) + (m - 2) (f(L, 4) - f(L, 2)) / 2,

and the one-row trace (an optimizer-step peak does not grow with ``m``), at the model's own depth. A deep model (`shallow_depths`) is traced at two shallower depths ``a < b`` instead (four
traces) and extrapolated bilinearly in ``L``. Both depths are deep enough that the blocks outweigh the embedding
and the head: with fewer layers the embedding's optimizer states set the peak at another moment of the step, and
the kinds stop being linear. The traces are cached per model and setting for the process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from torchrlhf.trainer.memory import trace_micro_batch


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
def _corners(model_path: str, kind: str, seq: tuple[int, int], dtype: torch.dtype, lora: Any,
             activation_checkpointing: bool, optim: tuple, use_kl_loss: bool) -> tuple[dict[str, float], ...]:
    prompt_len, response_len = seq
    out = []
    for rows in (1, 2, 4):
        out.append(trace_micro_batch(
            model_path, dtype=dtype, micro=rows, prompt_len=prompt_len, response_len=response_len,
            train=kind != "forward", value_head=kind == "value", lora=lora,
            activation_checkpointing=activation_checkpointing, optim=dict(optim) if optim else None,
            use_kl_loss=use_kl_loss))
    return tuple(out)


def micro_batch_memory(model_path: str, *, kind: str, micro: int, prompt_len: int, response_len: int,
                       dtype: torch.dtype, lora: Any = None, activation_checkpointing: bool = False,
                       optim: dict | None = None, use_kl_loss: bool = False,
                       depths: tuple[int, int] | None = None, layers: int = 0) -> dict[str, float]:
    """Peak bytes by kind of one unsharded micro-batch of ``micro`` × (``prompt_len`` + ``response_len``) tokens
    through ``model_path``'s architecture, as `trace_micro_batch` would report it. ``kind``:
    ``"train"`` (an actor's forward, loss, backward and optimizer step), ``"value"`` (the critic's), ``"forward"``
    (a frozen model's). ``depths`` (`shallow_depths`): trace at those two depths and extrapolate to ``layers``."""
    setting = ((prompt_len, response_len), dtype, lora, activation_checkpointing, tuple(sorted((optim or {}).items())),
               use_kl_loss)
    if depths is None:
        return _in_rows(*_corners(model_path, kind, *setting), micro)
    (a, b) = depths
    fa = _in_rows(*_corners(_at_depth(model_path, a), kind, *setting), micro)
    fb = _in_rows(*_corners(_at_depth(model_path, b), kind, *setting), micro)
    return {k: max(0.0, fa.get(k, 0.0) + (layers - a) * (fb.get(k, 0.0) - fa.get(k, 0.0)) / (b - a))
            for k in {*fa, *fb}}


def _in_rows(f1: dict[str, float], f2: dict[str, float], f4: dict[str, float], micro: int) -> dict[str, float]:
    if micro == 1:
        return dict(f1)
    line = {k: max(0.0, f2.get(k, 0.0) + (micro - 2) * (f4.get(k, 0.0) - f2.get(k, 0.0)) / 2) for k in {*f2, *f4}}
    return line if sum(line.values()) >= sum(f1.values()) else dict(f1)


__all__ = ["micro_batch_memory", "shallow_depths"]
