"""The policy role: log-probs of responses, PPO-family updates; frozen, it serves as the reference policy.

The reference policy is a separate `ActorWorker(freeze=True)` (no optimizer)
rather than a second copy inside the actor: the runtime colocates roles on the
same ranks, so one class covers both and a frozen worker never holds optimizer
state. A LoRA actor (``lora``) is its own reference: its base model with the adapters
switched off, in the same process and memory. Generation is the rollout role's (`RolloutWorker`): colocated, it reads
this worker's training weights in the same process; on its own ranks, it
receives them from `send_weights`.
"""

from __future__ import annotations

from typing import Any

import torch

from torchrlhf.algorithms import PolicyLoss, agg_loss, compute_policy_loss, kl_penalty
from torchrlhf.algorithms.rollout_is import rollout_is_weights
from torchrlhf.config import as_section
from torchrlhf.data import Batch
from torchrlhf.hybrid.broadcast import Manifest, send_weights, weight_manifest
from torchrlhf.models.lm_head import LogProbHead
from torchrlhf.models.lora import LoRAConfig, adapter_disabled, is_adapter
from torchrlhf.models.moe import (
    MoETraining,
    Replay,
    RoutingRecord,
    expert_load,
    is_moe,
    load_balancing_loss,
    record_routing,
    router_z_loss,
)
from torchrlhf.models.packed_attention import PrefixKV, sliding_window
from torchrlhf.runtime.registry import process_group
from torchrlhf.runtime.worker import Dispatch, register
from torchrlhf.workers.base import FSDPWorker, MemorySaving, MiniBatchTotals, TrainingRun, resolve_dtype
from torchrlhf.workers.microbatch import Batching, pad_response_columns, trimmed_inputs
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, scatter_responses, suffix_forward


class ActorWorker(FSDPWorker):
    """FSDP2 (× TP) policy. Arguments mirror the ``actor`` config section.

    ``optim``: the optimizer (``_component_``, default `torch.optim.AdamW`, with its own arguments), the
    LR schedule keys and ``clip_grad`` (`torchrlhf.utils.optim`). ``batching``: global mini-batch sizes in
    prompts, epochs, micro-batches (`Batching`); micro-batching only changes speed, never the result.
    ``run`` (`TrainingRun`, set by the controller from ``rollout.n`` and ``trainer.total_steps``): its
    ``total_steps`` and the schedule's ``warmup_steps`` count `update` calls (training iterations).
    ``loss`` (`PolicyLoss`): the policy loss, its clipping and aggregation, the entropy and KL terms, and
    the rollout correction ``rollout_is``.
    ``shared_prefix`` (on by default) computes each distinct prompt once per mini-batch, packs the
    responses without padding and projects to the vocabulary only at response positions
    (`workers.shared_prefix`); off, every sample runs as its own padded row (the dense reference).
    ``memory`` (`MemorySaving`): ``activation_checkpointing``, ``cpu_offload`` and
    ``offload_prefix_activations``, which keeps what that prompt pass saves for backward in host memory while
    the suffix micro-batches run (`utils.activation_offload`): the device then holds the prompts' keys/values
    and one suffix micro-batch, not every prompt's activations too. Results are identical; it pays two copies
    of those activations per mini-batch and frees nothing on a CPU device.
    ``freeze``: the reference policy or the distillation teacher (no optimizer; `compute_ref_log_prob` /
    `compute_teacher_log_prob` only).
    ``lora`` (`LoRAConfig`: ``rank``, ``alpha``, ``dropout``, ``target_modules``; off when None): train
    low-rank adapters on the frozen model (`models.lora`). Only the adapters get gradients, optimizer
    state, checkpoints and weight syncs; `compute_ref_log_prob` is the base model (adapters off).
    ``moe`` (`models.moe.MoETraining`), for a mixture-of-experts policy: ``aux_loss_coef`` adds this times the
    load-balancing loss (`models.moe.load_balancing_loss`, transformers' over every real token of each
    micro-batch's sequences, in the dense and the shared-prefix layouts alike; token-weighted over
    micro-batches). 0 (the default, as verl's FSDP actor) adds none; Qwen3-MoE's own configs use 0.001.
    ``z_loss_coef`` adds this times ST-MoE's router z-loss (`models.moe.router_z_loss`, over the same tokens with
    the same weights); 0 (the default) adds none, ST-MoE used 0.001. Either way ``moe/aux_loss``,
    ``moe/z_loss`` and ``moe/expert_load/max_over_mean`` are logged for an MoE policy.
    ``ep_size``: expert parallelism for a mixture-of-experts policy: each sparse block's experts split over
    ``ep_size`` adjacent data-parallel ranks, tokens sent to their experts' ranks and back by all-to-all
    (`models.expert_parallel.shard_experts`), FSDP2 sharding each rank's experts over the other ranks.
    ``moe.router_replay``: ``"rollout"`` routes every response token (as an input) to the experts the rollout
    engine chose for it (the batch's ``routed_experts``, `NativeEngine(record_routes=True)`) in the actor's
    old-log-prob and update forwards; the gate weights still come from the actor's router, which keeps its
    gradient. ``"off"``: the actor routes by itself. Whenever the batch has ``routed_experts``,
    ``moe/routing_agreement`` is logged: the share of the engine's choices the actor's own router makes.
    """

    role = "actor"
    OPTIM_DEFAULTS = {"lr": 1e-6, "weight_decay": 0.01}

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        optim: dict[str, Any] | None = None,
        batching: Batching | None = None,
        run: TrainingRun = TrainingRun(),
        loss: PolicyLoss = PolicyLoss(),
        tp_size: int = 1,
        ep_size: int = 1,
        memory: MemorySaving = MemorySaving(),
        compile: bool = False,
        shared_prefix: bool = True,
        lora: LoRAConfig | None = None,
        moe: MoETraining = MoETraining(),
        freeze: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(tp_size=tp_size, ep_size=ep_size, seed=seed)
        self.lora = LoRAConfig.of(lora)
        if self.lora is not None and freeze:
            raise ValueError("a frozen ActorWorker (the reference) takes no lora: a LoRA actor is its own reference")
        self.freeze = freeze
        self.loss = as_section(PolicyLoss, loss)
        memory = as_section(MemorySaving, memory)
        self._set_shared_prefix(shared_prefix, memory)
        rollout_is = self.loss.rollout_is is not None
        self.loss_metrics = ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                             "actor/ppo_kl", *(("actor/kl_loss",) if self.loss.use_kl_loss else ()),
                             *(("actor/rollout_is_mean", "actor/rollout_is_clipped_frac") if rollout_is else ()))
        self.max_metrics = ("actor/rollout_is_max",) if rollout_is else ()

        self.model = self._build_model(model_path, resolve_dtype(dtype), freeze=freeze, memory=memory,
                                       compile=compile)
        self.window = sliding_window(self.model.config)
        self.num_experts = getattr(self.model.config, "num_experts", 0) if is_moe(self.model.config) else 0
        self.moe = as_section(MoETraining, moe)
        if self.moe.asked and not self.num_experts:
            raise ValueError(f"actor.moe.{self.moe.asked[0]}: the policy ({self.model.config.model_type}) has no "
                             "mixture-of-experts router")
        self.router_replay = self.moe.router_replay == "rollout"
        if self.num_experts:
            self.loss_metrics += ("moe/aux_loss", "moe/z_loss", "moe/routing_agreement")
            self.max_metrics += ("moe/expert_load/max_over_mean",)
        self.lm_head: LogProbHead = self.model.get_output_embeddings()  # scores responses without logits
        if freeze:  # the reference: only no-grad passes, whose micro sizes come from ``batching``
            self.batching = batching if isinstance(batching, Batching) else Batching(**(batching or {}))
        else:
            self._init_training(optim=optim, batching=batching, run=as_section(TrainingRun, run),
                                loss_agg_mode=self.loss.agg_mode)

    # ------------------------------------------------------------------ weight sync (split placement)
    @register(dispatch=Dispatch.RANK_ZERO)
    def weight_manifest(self) -> Manifest:
        """(HF name, full shape) of every parameter `send_weights` streams, in that order: with LoRA the
        adapter factors only (the rollout side holds the frozen base and merges)."""
        return weight_manifest(self.model, is_adapter if self.lora is not None else None)

    @register(dispatch=Dispatch.ONE_TO_ALL, collect="first")
    def send_weights(self, sync_key: str, manifest: Manifest, dtype: str, bucket_bytes: int) -> dict[str, float]:
        """Broadcast the current weights to the rollout ranks (collective with `RolloutWorker.receive_weights`).

        Every actor rank gathers full tensors (FSDP2); this group's first rank, the only one in the sync
        group, broadcasts them bucket by bucket in ``dtype``.
        """
        group = process_group(sync_key) if self.group_rank == 0 else None
        stats = send_weights(self.model, group, self.ranks[0], manifest, resolve_dtype(dtype), bucket_bytes)
        return stats.as_dict()

    # ------------------------------------------------------------------ forward
    def _forward(self, mb: Batch, rows: list[int], plan: SharedPrefixPlan | None, prefix: PrefixKV | None,
                 temperature: float, with_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, RoutingRecord]:
        """Log-probs ``[b, R]`` (and entropy) of micro-batch ``mb``'s response tokens at ``temperature``.

        Shared prompts (``plan``): rows ``rows`` of the plan as one packed row reading ``prefix``. Dense: the
        micro-batch trimmed of all-padding columns, one padded row per sample. Either way only the positions
        that predict a response token are scored (no logits), and outputs are zero-padded to the response
        width so losses see the usual shapes. The entropy keeps its graph only for an entropy bonus.
        """
        width = mb["responses"].shape[1]
        if plan is not None:
            row = plan.suffix_row(rows, prefix, self.device)
            replay = self._replay(mb, [plan.response_len[r] + 1 for r in rows], 1)
            with self.lm_head.scoring(row.labels[None], temperature, entropy_grad=self.loss.entropy_coeff != 0), \
                    record_routing(self.model, replay) as routing:
                scores = suffix_forward(self.model, row)
            log_probs, entropy = scores.unbind(-1)
            log_probs = scatter_responses(log_probs, row, len(rows), width)
            entropy = scatter_responses(entropy, row, len(rows), width) if with_entropy else None
            return log_probs, entropy, routing
        inp = trimmed_inputs(mb, width)
        labels = mb["responses"][:, : inp.response_len]
        seq = inp.input_ids.shape[1]
        keep = torch.arange(seq - inp.response_len - 1, seq - 1, device=inp.input_ids.device)
        replay = self._replay(mb, [seq] * len(mb), seq - inp.response_len)
        with self.lm_head.scoring(labels, temperature, entropy_grad=self.loss.entropy_coeff != 0), \
                record_routing(self.model, replay) as routing:
            out = self.model(input_ids=inp.input_ids, attention_mask=inp.attention_mask,
                             position_ids=inp.position_ids, use_cache=False, logits_to_keep=keep)
        log_probs, entropy = out.logits.unbind(-1)
        return (pad_response_columns(log_probs, width), pad_response_columns(entropy, width) if with_entropy else None,
                routing)

    def _replay(self, mb: Batch, row_lengths: list[int], first: int) -> Replay | None:
        """The engine's experts for the forward's tokens when the batch has them (``routed_experts``): each
        sample's row holds ``row_lengths[j]`` tokens, its response starting at offset ``first`` (the dense
        rows: after the trimmed prompt; the shared-prefix rows: after the prompt's last token), and response
        token t's route (t below the response's length - 1: the last one fed no step) applies at its input
        position. They replace the actor's own choices with ``router_replay``; otherwise only compared."""
        if not self.num_experts or "routed_experts" not in mb:
            if self.router_replay:
                raise KeyError("actor.moe.router_replay=rollout: the batch has no 'routed_experts'; the rollout engine "
                               "must record them (rollout.engine.record_routes: true, NativeEngine)")
            return None
        routes = mb["routed_experts"]  # [b, R, moe_layers, top_k]
        lengths = mb["response_mask"].sum(-1).tolist()
        total = sum(row_lengths)
        experts = torch.zeros(total, *routes.shape[2:], dtype=torch.long, device=self.device)
        mask = torch.zeros(total, dtype=torch.bool, device=self.device)
        offset = 0
        for j, (row, n) in enumerate(zip(row_lengths, lengths)):
            fed = max(int(n) - 1, 0)
            experts[offset + first: offset + first + fed] = routes[j, :fed].long()
            mask[offset + first: offset + first + fed] = True
            offset += row
        return Replay(experts.transpose(0, 1), mask, force=self.router_replay)

    def _log_probs(self, batch: Batch, key: str, temperature: float, entropy: bool, name: str) -> Batch:
        """``key``: the output column; ``name``: the pass's, for ``perf/mfu/<name>``."""
        def fn(mb: Batch, rows: list[int], plan, prefix) -> dict[str, torch.Tensor]:
            lp, ent, _ = self._forward(mb, rows, plan, prefix, temperature, entropy)
            return {key: lp} if ent is None else {key: lp, "entropys": ent}

        return self.infer(batch, fn, name)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch, *, temperature: float, entropy: bool = False) -> Batch:
        """``old_log_probs [B,R]`` at ``temperature`` (+ per-token ``entropys`` with ``entropy``)."""
        return self._log_probs(batch, "old_log_probs", temperature, entropy, "old_log_prob")

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch, *, temperature: float) -> Batch:
        """``ref_log_prob [B,R]`` from the frozen reference weights: this frozen worker's, or a LoRA actor's
        base model (its adapters off for the pass)."""
        if self.lora is not None:
            with adapter_disabled(self.model):
                return self._log_probs(batch, "ref_log_prob", temperature, False, "ref")
        if not self.freeze:
            raise RuntimeError("compute_ref_log_prob is served by a frozen ActorWorker (freeze=True), the reference "
                               "role, or by a LoRA actor")
        return self._log_probs(batch, "ref_log_prob", temperature, False, "ref")

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_teacher_log_prob(self, batch: Batch, *, temperature: float) -> Batch:
        """``teacher_log_prob [B,R]``: a frozen ActorWorker (the distillation teacher, its own model; never a
        LoRA actor's base, which is the student's start, not a teacher) scoring the student's tokens."""
        if not self.freeze:
            raise RuntimeError("compute_teacher_log_prob is served by a frozen ActorWorker (freeze=True), the "
                               "teacher role")
        return self._log_probs(batch, "teacher_log_prob", temperature, False, "teacher")

    # ------------------------------------------------------------------ update
    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch: Batch, *, temperature: float) -> dict[str, float]:
        """One PPO-family update over the rollout (`FSDPWorker.train`): policy loss (+ entropy bonus, KL loss,
        rollout importance weights) at the sampling ``temperature``."""
        if self.freeze:
            raise RuntimeError("a frozen ActorWorker (reference) cannot be updated")
        num_mini = self.check_local_batch(batch)
        if "old_log_probs" not in batch and (num_mini > 1 or self.batching.ppo_epochs > 1):
            raise KeyError(
                f"actor.update: batch lacks 'old_log_probs', which {num_mini} mini-batches x "
                f"{self.batching.ppo_epochs} epochs need (only a single optimizer step per rollout may use its own "
                "log-probs, detached)"
            )
        needs = ["responses", "input_ids", "attention_mask", "response_mask", "advantages"]
        needs += ["ref_log_prob"] if self.loss.use_kl_loss else []
        needs += ["rollout_log_probs"] if self.loss.rollout_is else []
        return self.train(batch, needs=needs, temperature=temperature)

    def micro_batch_loss(self, mb: Batch, rows: list[int], plan: SharedPrefixPlan | None, prefix: PrefixKV | None,
                         totals: MiniBatchTotals, *, real: bool, temperature: float
                         ) -> tuple[torch.Tensor, dict[str, float]]:
        log_prob, entropy, routing = self._forward(mb, rows, plan, prefix, temperature, with_entropy=True)
        mask = mb["response_mask"].to(log_prob.dtype)
        tokens, normalizer = max(totals.tokens, 1.0), totals.normalizer
        stats: dict[str, float] = {}
        router_loss = self._router_loss(routing, mb, rows, plan, prefix, float(mask.sum()) / tokens, real, stats)
        if real and self.num_experts:
            stats["moe/routing_agreement"] = routing.agreement * float(mask.sum()) / tokens
        # One optimizer step per rollout: the sampling policy is the one being updated, so the
        # old log-probs are these log-probs detached (ratio 1, the exact on-policy gradient).
        old_log_prob = mb["old_log_probs"] if "old_log_probs" in mb else log_prob.detach()
        is_weights = None
        if self.loss.rollout_is:
            is_weights, ratios = rollout_is_weights(old_log_prob, mb["rollout_log_probs"], mask,
                                                    **self.loss.rollout_is_args)
            if real:
                bounded = (ratios > self.loss.rollout_is_threshold).float()
                stats["actor/rollout_is_mean"] = float((is_weights * mask).sum()) / tokens
                stats["actor/rollout_is_clipped_frac"] = float((bounded * mask).sum()) / tokens
                stats["actor/rollout_is_max"] = float(ratios.max())
        pg_loss, pg_metrics = compute_policy_loss(
            self.loss.policy_loss, old_log_prob, log_prob, mb["advantages"], mask,
            loss_agg_mode=self.loss.agg_mode, normalizer=normalizer, tis_weights=is_weights, **self.loss.clip,
        )
        ent_loss = agg_loss(entropy, mask, self.loss.agg_mode, normalizer=normalizer)
        loss = pg_loss - self.loss.entropy_coeff * ent_loss
        if router_loss is not None:
            loss = loss + router_loss
        if self.loss.use_kl_loss:
            kl = kl_penalty(log_prob, mb["ref_log_prob"], self.loss.kl_loss_type)
            kl_loss = agg_loss(kl, mask, self.loss.agg_mode, normalizer=normalizer)
            loss = loss + self.loss.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = float(kl_loss.detach())
        if real:
            share = float(mask.sum()) / tokens  # token-weighted mean of per-micro-batch ratios
            stats["actor/pg_loss"] = float(pg_loss.detach())
            stats["actor/entropy"] = float(ent_loss.detach())
            for name in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                stats[f"actor/{name}"] = float(pg_metrics[name]) * share
        return loss, stats

    def _router_loss(self, routing: RoutingRecord, mb: Batch, rows: list[int], plan: SharedPrefixPlan | None,
                     prefix: PrefixKV | None, share: float, real: bool, stats: dict[str, float]
                     ) -> torch.Tensor | None:
        """The micro-batch's router terms of the loss (the load-balancing loss and the z-loss times their
        coefficients; None when both are 0 or the model is dense), and its routing metrics. Each term is taken
        over every token of the micro-batch's sequences, weighted by its ``share`` of the mini-batch's response
        tokens (so the sum over micro-batches is their token-weighted mean). Dense rows count their real tokens (padding excluded, as
        transformers does with an attention mask). With shared prompts, the micro-batch's suffix row (each
        sample's last prompt token and response) joins the prefix pass's routing, each prompt token counted
        once per sample of the micro-batch that repeats it (the shared-prefix paper's logical prefix tokens):
        the dense layout's loss, whose gradient reaches the prefix pass through `PrefixKV.backward`."""
        if not self.num_experts:
            return None
        weights = None if plan is not None else trimmed_inputs(mb, mb["responses"].shape[1]).attention_mask.reshape(-1)
        if plan is not None and prefix is not None and prefix.routing is not None:
            prompts = prefix.routing
            routing = RoutingRecord([torch.cat(pair) for pair in zip(prompts.logits, routing.logits, strict=True)],
                                    [torch.cat(pair) for pair in zip(prompts.experts, routing.experts, strict=True)])
            suffix = routing.logits[0].shape[0] - prompts.logits[0].shape[0]
            weights = torch.cat([plan.prefix_token_weights(rows), torch.ones(suffix)]).to(self.device)
        aux = load_balancing_loss(routing, self.num_experts, weights) * share
        z = router_z_loss(routing, weights) * share
        if real:
            load = expert_load(routing, self.num_experts)
            stats["moe/aux_loss"] = float(aux.detach())
            stats["moe/z_loss"] = float(z.detach())
            stats["moe/expert_load/max_over_mean"] = float(load.max() / load.mean().clamp(min=1e-9))
        terms = [coef * term for coef, term in ((self.moe.aux_loss_coef, aux), (self.moe.z_loss_coef, z)) if coef]
        return sum(terms[1:], terms[0]) if terms else None
