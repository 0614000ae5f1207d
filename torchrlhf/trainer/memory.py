"""The dry run's training memory: one micro-batch traced on fake tensors, not a hand formula.

A hand count of activations (values per hidden unit per token and layer) was 1.4-1.6x low on an H100:
it misses the attention and MLP temporaries, the fused head's tiles, the loss's tensors, the gradients
being built during backward. Here the role's model is built from its ``config.json`` under
`torch._subclasses.FakeTensorMode` (shapes and dtypes, no storage), and one micro-batch of the longest
prompts and responses runs through the same code the workers run: the model with its `LogProbHead`
(the dense path of `ActorWorker._forward`), the policy loss and its aggregation, backward, and the
optimizer `build_optimizer` makes, stepped once. `torch.distributed._tools.MemTracker` records every live
tensor by kind (parameters, gradients, optimizer states, activations, temporaries); its peak is what one
rank holds for that role at the worst moment of the step.

What differs from a worker (said in the dry run's output too):
- the trace runs unsharded in the compute dtype on one process: parameters, gradients and optimizer
  states are then recounted as the worker holds them (`as_held`: float32 master copies, sharded over the
  role's ranks by FSDP2 or with compute copies on one rank, as `models.parallelize.model_layout` says) — exact arithmetic,
  not an approximation; activations and temporaries are the traced ones (divided by TP, whose split of
  the hidden units the trace does not run);
- the fake tensors are CPU tensors, but the head scores in the tiles of the device the role trains on
  (`run_device_type` for the dry run, the hardware profile's for the planner): a GPU's tiles hold ~30x a CPU's;
- with ``shared_prefix`` the step is the shared-prefix schedule (`trace_shared_prefix_update`): a rank's
  distinct prompts once, their keys/values and graph alive through the suffix micro-batches (the old estimate,
  a dense micro-batch, undercounted this when a rank holds more prompt tokens than one micro-batch); with
  ``offload_prefix_activations`` what that pass saves goes to a storage-less stand-in for host memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from torchrlhf.algorithms.aggregation import agg_loss
from torchrlhf.algorithms.kl import kl_penalty
from torchrlhf.algorithms.logprob import tile_sizes
from torchrlhf.algorithms.policy_loss import compute_policy_loss
from torchrlhf.models.heads import build_meta_value_model
from torchrlhf.models.lm_head import LogProbHead
from torchrlhf.models.lora import hold_frozen_in, inject_lora
from torchrlhf.models.moe import traceable_experts
from torchrlhf.models.parallelize import enable_activation_checkpointing
from torchrlhf.models.sharded import build_meta_causal_lm
from torchrlhf.data import Batch
from torchrlhf.utils.optim import build_optimizer
from torchrlhf.workers.microbatch import Batching
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, prefix_forward, scatter_responses, suffix_forward

# MemTracker's kinds, as the dry run names them
KINDS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Optstate": "optimizer states",
         "Activation": "activations", "Temp": "temporaries", "Other": "other"}
STATE_KINDS = ("parameters", "gradients", "optimizer states")
# what a trained role holds only during its own calls (its gradients are freed after each optimizer step); the
# rest (parameters, buffers, optimizer states) it holds throughout the step
WORKING_KINDS = ("gradients", "activations", "temporaries", "other")


class _NoHook:
    def remove(self) -> None:
        pass


@dataclass(frozen=True)
class StepMemory:
    """Peak bytes by kind of a traced step, split as `plan.memory` needs to deepen a shallow copy of the model:
    ``passes`` (forward and backward), ``optimizer`` (its step; empty when not trained), and ``block_outputs``, the
    moments the blocks' output reaches the final norm, one per forward in order: every block's saved
    activations (and, in a no-grad pass, every block's keys and values the pass still holds) are alive then, so
    each grows with depth as a deep model's peak may, where a shallow model's peak is set by the embedding, the
    head or one block's temporaries instead."""

    passes: dict[str, float]
    optimizer: dict[str, float] = field(default_factory=dict)
    block_outputs: list[dict[str, float]] = field(default_factory=list)
    offloaded: float = 0.0  # host bytes of the prompts' pass (`trace_shared_prefix_update`'s ``offload``)

    @property
    def peak(self) -> dict[str, float]:
        """The whole step's peak: the larger of its passes' and its optimizer step's."""
        return max(self.passes, self.optimizer, key=lambda f: sum(f.values()))


def _by_kind(snapshot: dict) -> dict[str, float]:
    """A `MemTracker` snapshot in the dry run's kinds, summed over devices; the ``meta`` device (a stand-in for
    host memory) not counted."""
    by_kind: dict[str, float] = {}
    for device, device_stats in snapshot.items():
        if torch.device(device).type == "meta":
            continue
        for kind, n in device_stats.items():
            if kind in KINDS and n:
                by_kind[KINDS[kind]] = by_kind.get(KINDS[kind], 0) + n
    return by_kind


class _FrozenAwareMemTracker(MemTracker):
    """`MemTracker` for models with frozen parameters (a reference, a LoRA base), keeping the global peak
    only, split into phases (`end_phase`), and the moments marked (`mark`). torch 2.13's
    tracker registers a gradient hook on every parameter, which a tensor without ``requires_grad`` refuses;
    and after every op it walks every module's stats for per-module peaks (O(ops x modules): minutes for
    SmolLM2), which the dry run does not print."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[dict[str, float]] = []

    def mark(self) -> None:
        """Keep the current snapshot."""
        self.marks.append(_by_kind(self.get_tracker_snapshot("current")))

    def end_phase(self) -> dict[str, float]:
        """The peak since the last phase ended; the next phase's peak starts from the current state."""
        peak = _by_kind(self.get_tracker_snapshot("peak"))
        self._peak_mem_snap = self.get_tracker_snapshot("current")
        self._peak_mem = {dev: snap["Total"] for dev, snap in self._peak_mem_snap.items()}
        return peak

    def _update_peak_stats(self, peak_state) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def run_device_type() -> str:
    """The device type a run's workers train on here: "cuda" where there is one (`runtime.worker`)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _materialize_fake(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` (built on meta) with fake CPU tensors in place of its parameters and buffers, floating
    ones in ``dtype``; tied parameters stay tied. Call under the `FakeTensorMode`."""
    fresh: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fresh:
            like = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device="cpu")
            fresh[id(t)] = torch.nn.Parameter(like, t.requires_grad) if isinstance(t, torch.nn.Parameter) else like
        return fresh[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b)
    return model


def _hold_optimizer_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, keep_gradients: bool) -> None:
    """One optimizer step on zero gradients, before the traced step: the optimizer states a worker holds from
    its second step on then exist, as a traced first forward and backward would leave them, at none of its cost.
    ``keep_gradients``: the zero gradients stay, as a micro-batch after its mini-batch's first holds the earlier
    ones' gradients throughout (its backward sums into them)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    if not keep_gradients:
        optimizer.zero_grad(set_to_none=True)


def _trace(model_path: str, step: Callable[[torch.nn.Module, _FrozenAwareMemTracker], torch.Tensor | None], *,
           dtype: torch.dtype, train: bool, value_head: bool, lora: Any, activation_checkpointing: bool,
           optim: dict | None, device_type: str, accumulating: bool = False) -> StepMemory:
    """Peak bytes by kind of ``step(model, tracker)`` (which returns the loss to backward, or None after
    running its own backward passes) and, when ``train``, one optimizer step, on the role's model built on fake
    tensors. Tensors on the ``meta`` device (stand-ins for host memory) are not counted. The head scores in
    the tiles it uses on ``device_type`` (a GPU's hold ~30x the temporaries of a CPU's), though the fake tensors
    are CPU tensors. ``accumulating``: the gradients held from the start (`_hold_optimizer_states`)."""
    model = build_meta_value_model(model_path) if value_head else build_meta_causal_lm(model_path)
    head = model.get_output_embeddings() if not value_head else None
    if isinstance(head, LogProbHead):
        head.tiles = tile_sizes(torch.device(device_type))
    if not train:
        model.requires_grad_(False)
    if lora is not None:
        inject_lora(model, lora)
    # inputs the step builds from Python data (index tensors, plans) stay real: they are constants here
    with FakeTensorMode(allow_non_fake_inputs=True), traceable_experts(model):
        model = _materialize_fake(model, dtype)
        if lora is not None and dtype.itemsize < 4:
            hold_frozen_in(model, dtype)
        if train and activation_checkpointing:
            enable_activation_checkpointing(model)
        optimizer = None
        if train:
            optimizer, _ = build_optimizer(model.parameters(), {"lr": 1e-6, **(optim or {})})
            _hold_optimizer_states(model, optimizer, keep_gradients=accumulating)
        tracker = _FrozenAwareMemTracker()
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        model.model.norm.register_forward_pre_hook(lambda *_: tracker.mark())  # the blocks' output: `StepMemory`
        with tracker:
            with torch.set_grad_enabled(train):
                loss = step(model, tracker)
            if train and loss is not None:
                loss.backward()
            passes = tracker.end_phase()
            if train:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            optimizer_step = tracker.end_phase() if train else {}
    return StepMemory(passes=passes, optimizer=optimizer_step, block_outputs=tracker.marks)


def trace_micro_batch(
    model_path: str,
    *,
    dtype: torch.dtype,
    micro: int,
    prompt_len: int,
    response_len: int,
    train: bool = True,
    value_head: bool = False,
    lora: Any = None,
    activation_checkpointing: bool = False,
    optim: dict | None = None,
    use_kl_loss: bool = False,
    device_type: str = "cpu",
    accumulating: bool = False,
    phases: bool = False,
) -> dict[str, float] | StepMemory:
    """Peak bytes by kind of one micro-batch of ``micro`` samples of ``prompt_len + response_len`` tokens:
    forward (+ loss, backward and one optimizer step when ``train``), unsharded, in ``dtype``, on fake
    tensors (nothing is allocated), with the head's tiles of ``device_type`` (`run_device_type`).
    ``value_head``: the critic's `ValueModel` and a squared-error loss. ``accumulating``: a micro-batch after
    its mini-batch's first, the earlier ones' gradients held throughout (a lone micro-batch builds them during
    its backward, so its peak can hold fewer): exact for it, an upper bound for a lone one. ``phases``: the
    `StepMemory` instead."""
    seq = prompt_len + response_len

    def step(model, tracker) -> torch.Tensor:
        input_ids = torch.zeros(micro, seq, dtype=torch.long)
        attention_mask = torch.ones(micro, seq, dtype=torch.long)
        position_ids = torch.arange(seq).expand(micro, seq)
        if value_head:
            values = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
            values = values[:, -response_len - 1:-1] if values.dim() == 2 else values
            return (values.float() ** 2).mean()
        return actor_loss(model, input_ids, attention_mask, position_ids, response_len, use_kl_loss)

    traced = _trace(model_path, step, dtype=dtype, train=train, value_head=value_head, lora=lora,
                    activation_checkpointing=activation_checkpointing, optim=optim, device_type=device_type,
                    accumulating=accumulating and train)
    return traced if phases else traced.peak


def shared_prefix_shape(batching: Batching, *, n: int, dp: int, step_prompts: int, response_len: int,
                        frozen: bool = False) -> dict[str, int]:
    """One rank's part of a shared-prefix pass, as `trace_shared_prefix_update` takes it: ``prompts``, the
    distinct prompts its prompts' pass holds (a mini-batch's in an update, the step's ``step_prompts`` in a
    frozen role's no-grad pass), ``n`` samples of each, and ``micro`` samples per suffix micro-batch (a token
    budget's worth of the longest suffixes under ``use_dynamic_bsz``)."""
    group = step_prompts if frozen else batching.ppo_mini_batch_size
    prompts = max(1, math.ceil(group / dp))
    micro = batching.log_prob_micro_batch_size if frozen else batching.ppo_micro_batch_size_per_device
    if batching.use_dynamic_bsz:
        micro = max(1, batching.max_tokens // (1 + response_len))
    return {"prompts": prompts, "n": max(1, (group * n // dp) // prompts), "micro": micro}


def trace_shared_prefix_update(
    model_path: str,
    *,
    dtype: torch.dtype,
    prompts: int,
    n: int,
    micro: int,
    prompt_len: int,
    response_len: int,
    offload: bool = False,
    value_head: bool = False,
    lora: Any = None,
    activation_checkpointing: bool = False,
    optim: dict | None = None,
    use_kl_loss: bool = False,
    train: bool = True,
    suffix_passes: int | None = 2,
    device_type: str = "cpu",
    phases: bool = False,
) -> dict[str, float] | StepMemory:
    """Peak bytes by kind of one shared-prefix mini-batch on one rank: ``prompts`` distinct prompts of
    ``prompt_len`` tokens with ``n`` responses of ``response_len`` each, as `FSDPWorker.train` runs it: the
    prompts' pass once, suffix micro-batches of ``micro`` samples (forward, loss, backward), the prompts'
    backward, one optimizer step (``train``; else the no-grad passes); unsharded, on fake tensors, worst case
    for the prefix (every prompt full length, no two equal). ``suffix_passes``: how many suffix
    micro-batches to run (None: all). The second is the steady state (the gradients of the parameters and of
    the prompts' keys/values exist from the first on; each pass frees what it allocates), so two give the
    peak of any number.

    ``offload`` (``offload_prefix_activations``): the prompt pass's saved tensors go to a storage-less device
    standing in for host memory, so the peak counts what the accelerator holds; ``"offloaded"`` is the host
    bytes then held. ``device_type``: the head's tiles, as `trace_micro_batch`'s. ``phases``: the `StepMemory`
    instead (its ``offloaded`` the host bytes).
    """
    ids = torch.zeros(prompts, prompt_len, dtype=torch.long)
    ids[:, 0] = torch.arange(prompts)  # a distinct first token: no two prompts are shared
    responses = torch.zeros(prompts * n, response_len, dtype=torch.long)
    batch = Batch({"input_ids": torch.cat([ids.repeat_interleave(n, 0), responses], 1), "responses": responses,
                   "attention_mask": torch.ones(prompts * n, prompt_len + response_len, dtype=torch.long)})
    plan = SharedPrefixPlan(batch)
    samples = list(range(prompts * n))
    chunks = [samples[i: i + micro] for i in range(0, len(samples), micro)][:suffix_passes]
    moved = {}

    def step(model, tracker) -> None:
        train = torch.is_grad_enabled()
        prefix = prefix_forward(model, plan, "cpu", offload_to="meta" if offload and train else None)
        for rows in chunks:
            tracker.reset_mod_stats()  # its per-module stats allow one root forward; the global peak stays
            row = plan.suffix_row(rows, prefix, "cpu")
            if value_head:
                loss = (suffix_forward(model, row).float() ** 2).mean()
            else:
                with model.get_output_embeddings().scoring(row.labels[None], 1.0, entropy_grad=True):
                    scores = suffix_forward(model, row)
                log_prob = scatter_responses(scores[..., 0], row, len(rows), response_len)
                loss = _ppo_loss(log_prob, scatter_responses(scores[..., 1], row, len(rows), response_len),
                                 use_kl_loss)
            if train:
                loss.backward()
        if train:
            prefix.backward()
        moved["bytes"] = prefix.offloaded_bytes

    traced = _trace(model_path, step, dtype=dtype, train=train, value_head=value_head, lora=lora,
                    activation_checkpointing=activation_checkpointing, optim=optim, device_type=device_type)
    traced = replace(traced, offloaded=moved["bytes"])
    return traced if phases else {**traced.peak, "offloaded": traced.offloaded}


def actor_loss(model, input_ids, attention_mask, position_ids, response_len: int, use_kl_loss: bool):
    """`ActorWorker.micro_batch_loss` on the dense path: log-probs and entropy of the response positions
    from the `LogProbHead` (no logits), the PPO loss with its entropy term (and the KL loss)."""
    seq = input_ids.shape[1]
    labels = input_ids[:, seq - response_len:]
    keep = torch.arange(seq - response_len - 1, seq - 1)
    with model.get_output_embeddings().scoring(labels, 1.0, entropy_grad=True):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=False, logits_to_keep=keep)
    log_prob, entropy = out.logits.unbind(-1)
    return _ppo_loss(log_prob, entropy, use_kl_loss)


def _ppo_loss(log_prob: torch.Tensor, entropy: torch.Tensor, use_kl_loss: bool) -> torch.Tensor:
    """The PPO loss with its entropy term (and the KL loss) over ``[samples, responses]`` log-probs."""
    mask = torch.ones_like(log_prob)
    advantages = torch.zeros_like(log_prob)
    pg_loss, _ = compute_policy_loss("ppo", log_prob.detach(), log_prob, advantages, mask,
                                     loss_agg_mode="token-mean", normalizer=float(mask.numel()))
    loss = pg_loss - 0.0 * agg_loss(entropy, mask, "token-mean", normalizer=float(mask.numel()))
    if use_kl_loss:
        loss = loss + 0.001 * agg_loss(kl_penalty(log_prob, torch.zeros_like(log_prob), "k3"), mask, "token-mean",
                                       normalizer=float(mask.numel()))
    return loss


def as_held(traced: dict[str, float], *, dtype: torch.dtype, shards: int, tp: int, layout: str,
            lora: bool = False) -> dict[str, float]:
    """The traced kinds as one rank of the role holds them (``layout``: `models.parallelize.model_layout`).
    With ``"fsdp"`` parameters, gradients and optimizer states are split over ``shards`` ranks and, below
    float32, held as float32 master copies (a LoRA model keeps its frozen base in ``dtype`` and its adapters
    in float32 already, as traced). With ``"copies"`` they are float32 on the one rank, and the parameters'
    compute copies in ``dtype`` come on top. ``"plain"`` holds them as traced. The micro-batch's activations
    and temporaries split over ``tp``."""
    master = 1.0 if lora else 4 / dtype.itemsize
    held = {}
    for kind, n in traced.items():
        if kind not in STATE_KINDS:
            held[kind] = n / tp
        elif layout == "fsdp":
            held[kind] = n * master / shards
        elif layout == "copies":
            held[kind] = n * (master + 1 if kind == "parameters" else master)
        else:
            held[kind] = n
    return held


__all__ = ["KINDS", "STATE_KINDS", "WORKING_KINDS", "StepMemory", "actor_loss", "as_held", "run_device_type",
           "shared_prefix_shape", "trace_micro_batch", "trace_shared_prefix_update"]
