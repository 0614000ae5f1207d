"""The policy role: log-probs of responses, PPO-family updates; frozen, it serves as the reference policy.

The reference policy is a separate `ActorWorker(freeze=True)` (no optimizer)
rather than a second copy inside the actor: the runtime colocates roles on the
same ranks, so one class covers both and a frozen worker never holds optimizer
state. Generation is the rollout role's (`RolloutWorker`): colocated, it reads
this worker's training weights in the same process; on its own ranks, it
receives them from `send_weights`.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from torchrlhf.algorithms import agg_loss, compute_policy_loss, kl_penalty
from torchrlhf.algorithms.rollout_is import check_rollout_is, rollout_is_weights
from torchrlhf.data import Batch
from torchrlhf.hybrid.broadcast import Manifest, send_weights, weight_manifest
from torchrlhf.models.lm_head import LogProbHead
from torchrlhf.models.packed_attention import PrefixKV, sliding_window
from torchrlhf.runtime.group import process_group
from torchrlhf.runtime.worker import Dispatch, register
from torchrlhf.workers.base import FSDPWorker, resolve_dtype
from torchrlhf.workers.microbatch import pad_response_columns, trimmed_inputs, validate_batch_sizes
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, run_prefixes, scatter_responses, suffix_forward

# batch.meta key asking compute_log_prob to also return per-token entropy ("entropys").
CALCULATE_ENTROPY = "calculate_entropy"


class ActorWorker(FSDPWorker):
    """FSDP2 (× TP) policy. Arguments mirror the ``actor`` config section (flat keys).

    Batch sizes are global and counted in prompts: a mini-batch is
    ``ppo_mini_batch_size * rollout_n`` responses split over the data-parallel
    ranks; micro-batches (``ppo_micro_batch_size_per_device`` samples, or token
    budgets with ``use_dynamic_bsz``) only change speed, never the result.
    ``total_steps``/``warmup_steps`` count `update` calls (training iterations).
    ``rollout_is`` ("token" / "sequence", off by default) weights each token's loss by the bounded
    ratio of the old policy to the rollout engine's log-probs (`algorithms.rollout_is`), which
    corrects for a rollout engine in another dtype or with older weights.
    ``shared_prefix`` (on by default) computes each distinct prompt once per mini-batch, packs the
    responses without padding and projects to the vocabulary only at response positions
    (`workers.shared_prefix`); off, every sample runs as its own padded row (the dense reference).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        lr: float = 1e-6,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        total_steps: int | None = None,
        lr_scheduler: str = "constant",
        min_lr_ratio: float = 0.0,
        grad_clip: float = 1.0,
        ppo_mini_batch_size: int = 1,
        rollout_n: int = 1,
        ppo_micro_batch_size_per_device: int = 1,
        log_prob_micro_batch_size_per_device: int | None = None,
        ppo_epochs: int = 1,
        policy_loss: str = "ppo",
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: float = 3.0,
        loss_agg_mode: str = "token-mean",
        entropy_coeff: float = 0.0,
        use_kl_loss: bool = False,
        kl_loss_coef: float = 0.001,
        kl_loss_type: str = "k3",
        rollout_is: str | None = None,
        rollout_is_mode: str = "truncate",
        rollout_is_threshold: float = 2.0,
        use_dynamic_bsz: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        tp_size: int = 1,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        shared_prefix: bool = True,
        freeze: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(tp_size=tp_size, seed=seed)
        if not freeze:
            validate_batch_sizes(
                ppo_mini_batch_size=ppo_mini_batch_size, rollout_n=rollout_n, dp_size=self.dp_size,
                ppo_micro_batch_size_per_device=ppo_micro_batch_size_per_device, use_dynamic_bsz=use_dynamic_bsz,
                max_tokens_per_micro_batch=max_tokens_per_micro_batch, role="actor",
            )
        if ppo_epochs <= 0:
            raise ValueError(f"actor.ppo_epochs must be positive, got {ppo_epochs}")
        try:
            check_rollout_is(rollout_is, rollout_is_mode, rollout_is_threshold)
        except ValueError as e:
            raise ValueError(f"actor.{e}") from None
        self.freeze = freeze
        self.grad_clip = grad_clip
        self.ppo_mini_batch_size = ppo_mini_batch_size
        self.rollout_n = rollout_n
        self.micro_batch_size = ppo_micro_batch_size_per_device
        self.log_prob_micro_batch_size = log_prob_micro_batch_size_per_device or ppo_micro_batch_size_per_device
        self.ppo_epochs = ppo_epochs
        self.policy_loss = policy_loss
        self.clip = {"clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high, "clip_ratio_c": clip_ratio_c}
        self.loss_agg_mode = loss_agg_mode
        self.entropy_coeff = entropy_coeff
        self.use_kl_loss = use_kl_loss
        self.kl_loss_coef = kl_loss_coef
        self.kl_loss_type = kl_loss_type
        self.rollout_is = {"level": rollout_is, "mode": rollout_is_mode, "threshold": rollout_is_threshold}
        self.max_tokens = max_tokens_per_micro_batch if use_dynamic_bsz else None
        self.shared_prefix = shared_prefix

        self.model = self._build_model(model_path, resolve_dtype(dtype), freeze=freeze,
                                       activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload)
        self.window = sliding_window(self.model.config)
        self.lm_head: LogProbHead = self.model.get_output_embeddings()  # scores responses without logits
        if not freeze:
            self._init_optimizer(lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps,
                                 total_steps=total_steps, lr_scheduler=lr_scheduler, min_lr_ratio=min_lr_ratio)

    # ------------------------------------------------------------------ weight sync (split placement)
    @register(dispatch=Dispatch.RANK_ZERO)
    def weight_manifest(self) -> Manifest:
        """(HF name, full shape) of every parameter, in the order `send_weights` streams them."""
        return weight_manifest(self.model)

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
    def _scoring(self, labels: torch.Tensor, temperature: float):
        """The head's scoring block; the entropy keeps its graph only when the loss has an entropy bonus."""
        return self.lm_head.scoring(labels, temperature, entropy_grad=self.entropy_coeff != 0)

    @staticmethod
    def _scores(scores: torch.Tensor, with_entropy: bool):
        """The head's ``[..., 2]`` scores -> (log-probs, entropy or None)."""
        log_probs, entropy = scores.unbind(-1)
        return log_probs, entropy if with_entropy else None

    def _forward(self, mb: Batch, temperature: float, with_entropy: bool):
        """Dense: log-probs ``[b, R]`` (and entropy) of the response tokens, one padded row per sample.

        The model runs on the micro-batch trimmed of all-padding columns and scores only the positions
        that predict a response column; outputs are zero-padded back to the full response width so
        losses see the usual shapes.
        """
        width = mb["responses"].shape[1]
        inp = trimmed_inputs(mb, width)
        labels = mb["responses"][:, : inp.response_len]
        seq = inp.input_ids.shape[1]
        keep = torch.arange(seq - inp.response_len - 1, seq - 1, device=inp.input_ids.device)
        with self._scoring(labels, temperature):
            out = self.model(input_ids=inp.input_ids, attention_mask=inp.attention_mask,
                             position_ids=inp.position_ids, use_cache=False, logits_to_keep=keep)
        log_probs, entropy = self._scores(out.logits, with_entropy)
        entropy = None if entropy is None else pad_response_columns(entropy, width)
        return pad_response_columns(log_probs, width), entropy

    def _forward_packed(self, plan: SharedPrefixPlan, prefix: PrefixKV, rows: list[int], width: int,
                        temperature: float, with_entropy: bool):
        """Shared-prefix: samples ``rows`` of the plan as one packed row reading ``prefix``; ``[b, R]`` outputs."""
        row = plan.suffix_row(rows, prefix, self.device)
        with self._scoring(row.labels[None], temperature):
            scores = suffix_forward(self.model, row)
        log_probs, entropy = self._scores(scores, with_entropy)
        log_probs = scatter_responses(log_probs, row, len(rows), width)
        entropy = None if entropy is None else scatter_responses(entropy, row, len(rows), width)
        return log_probs, entropy

    def _log_probs(self, batch: Batch, key: str, with_entropy: bool) -> Batch:
        temperature = float(batch.meta.get("temperature", 1.0))
        width = batch["responses"].shape[1]
        self.model.eval()
        lengths = None
        if self.shared_prefix:
            with torch.no_grad():
                plan, prefix, lengths = run_prefixes(self.model, batch, self.window, self.device)

        def fn(mb: Batch, rows: list[int]) -> dict[str, torch.Tensor]:
            if self.shared_prefix:
                lp, ent = self._forward_packed(plan, prefix, rows, width, temperature, with_entropy)
            else:
                lp, ent = self._forward(mb, temperature, with_entropy)
            return {key: lp} if ent is None else {key: lp, "entropys": ent}

        outs = self.map_micro_batches(batch, fn, micro_batch_size=self.log_prob_micro_batch_size,
                                      max_tokens=self.max_tokens, lengths=lengths)
        return Batch(outs, meta=batch.meta)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs [B,R]`` (+ ``entropys`` when ``batch.meta["calculate_entropy"]``) at meta["temperature"]."""
        return self._log_probs(batch, "old_log_probs", bool(batch.meta.get(CALCULATE_ENTROPY, False)))

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob [B,R]`` from the frozen reference weights."""
        if not self.freeze:
            raise RuntimeError("compute_ref_log_prob is served by a frozen ActorWorker (freeze=True), the reference role")
        return self._log_probs(batch, "ref_log_prob", False)

    # ------------------------------------------------------------------ update
    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch: Batch) -> dict[str, float]:
        """PPO epochs × mini-batches (one optimizer step each) × micro-batches (gradient accumulation).

        Each micro-batch loss is normalised by the whole mini-batch's global token
        (or sequence) count, so the accumulated gradient is the mini-batch gradient
        whatever the micro-batching and data-parallel split. FSDP averages gradients
        over data-parallel ranks, so the backward loss is scaled by ``dp_size``.
        """
        if self.freeze:
            raise RuntimeError("a frozen ActorWorker (reference) cannot be updated")
        num_mini = self.check_local_batch(batch, ppo_mini_batch_size=self.ppo_mini_batch_size,
                                          rollout_n=self.rollout_n, role="actor")
        needed = ["responses", "input_ids", "attention_mask", "response_mask", "advantages"]
        needed += ["ref_log_prob"] if self.use_kl_loss else []
        needed += ["rollout_log_probs"] if self.rollout_is["level"] else []
        if "old_log_probs" not in batch and (num_mini > 1 or self.ppo_epochs > 1):
            raise KeyError(
                f"actor.update: batch lacks 'old_log_probs', which {num_mini} mini-batches x {self.ppo_epochs} "
                "epochs need (only a single optimizer step per rollout may use its own log-probs, detached)"
            )
        missing = [k for k in needed if k not in batch]
        if missing:
            raise KeyError(f"actor.update: batch lacks columns {missing}; it has {batch.keys()}")
        temperature = float(batch.meta.get("temperature", 1.0))
        lr = self.current_lr
        self.model.train()
        sums: dict[str, list[float]] = defaultdict(list)
        skipped = 0
        for _ in range(self.ppo_epochs):
            for mini in self.mini_batches(batch, num_mini):
                stats = self._train_mini_batch(mini, temperature)
                grad_norm, skip = self.optimizer_step(self.grad_clip)
                skipped += int(skip)
                if not skip:
                    stats["actor/grad_norm"] = grad_norm
                for k, v in stats.items():
                    sums[k].append(v)
        self.lr_scheduler.step()
        metrics = {k: sum(v) / len(v) for k, v in sums.items()}
        metrics["actor/lr"] = lr
        metrics["actor/grad_norm_nonfinite"] = float(skipped > 0)
        metrics["actor/skipped_steps"] = float(skipped)
        return metrics

    def _train_mini_batch(self, mini: Batch, temperature: float) -> dict[str, float]:
        """Accumulate one mini-batch's gradient; returns its globally-reduced loss metrics."""
        mini_mask = mini["response_mask"]
        tokens, seqs = self.dp_sum([float(mini_mask.sum()), float((mini_mask.sum(-1) > 0).sum())])
        normalizer = tokens if self.loss_agg_mode == "token-mean" else seqs
        local: dict[str, float] = defaultdict(float)
        is_max = 0.0
        width = mini["responses"].shape[1]
        plan = prefix = lengths = None
        if self.shared_prefix:  # prompts forward once here, backward once after the micro-batches
            plan, prefix, lengths = run_prefixes(self.model, mini, self.window, self.device)
        for mb, index in self.micro_batches(mini, micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens,
                                            lengths=lengths):
            if plan is not None:
                rows = [0] if index is None else index.tolist()
                log_prob, entropy = self._forward_packed(plan, prefix, rows, width, temperature, with_entropy=True)
            else:
                log_prob, entropy = self._forward(mb, temperature, with_entropy=True)
            mask = mb["response_mask"].to(log_prob.dtype)
            # One optimizer step per rollout: the sampling policy is the one being updated, so the
            # old log-probs are these log-probs detached (ratio 1, the exact on-policy gradient).
            old_log_prob = mb["old_log_probs"] if "old_log_probs" in mb else log_prob.detach()
            is_weights = None
            if self.rollout_is["level"]:
                is_weights, ratios = rollout_is_weights(old_log_prob, mb["rollout_log_probs"], mask, **self.rollout_is)
                if index is not None:
                    bounded = (ratios > self.rollout_is["threshold"]).float()
                    local["actor/rollout_is_mean"] += float((is_weights * mask).sum()) / max(tokens, 1.0)
                    local["actor/rollout_is_clipped_frac"] += float((bounded * mask).sum()) / max(tokens, 1.0)
                    is_max = max(is_max, float(ratios.max()))
            pg_loss, pg_metrics = compute_policy_loss(
                self.policy_loss, old_log_prob, log_prob, mb["advantages"], mask,
                loss_agg_mode=self.loss_agg_mode, normalizer=normalizer, tis_weights=is_weights, **self.clip,
            )
            ent_loss = agg_loss(entropy, mask, self.loss_agg_mode, normalizer=normalizer)
            loss = pg_loss - self.entropy_coeff * ent_loss
            if self.use_kl_loss:
                kl = kl_penalty(log_prob, mb["ref_log_prob"], self.kl_loss_type)
                kl_loss = agg_loss(kl, mask, self.loss_agg_mode, normalizer=normalizer)
                loss = loss + self.kl_loss_coef * kl_loss
            weight = 0.0 if index is None else 1.0  # filler micro-batches only keep collectives in step
            (loss * (weight * self.dp_size)).backward()
            if index is None:
                continue
            share = float(mask.sum()) / max(tokens, 1.0)  # token-weighted mean of per-micro-batch ratios
            local["actor/pg_loss"] += float(pg_loss.detach())
            local["actor/entropy"] += float(ent_loss.detach())
            for name in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                local[f"actor/{name}"] += float(pg_metrics[name]) * share
            if self.use_kl_loss:
                local["actor/kl_loss"] += float(kl_loss.detach())
        if prefix is not None:
            prefix.backward()
        keys = ["actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"]
        keys += ["actor/kl_loss"] if self.use_kl_loss else []
        keys += ["actor/rollout_is_mean", "actor/rollout_is_clipped_frac"] if self.rollout_is["level"] else []
        stats = dict(zip(keys, self.dp_sum([local[k] for k in keys])))
        if self.rollout_is["level"]:
            (stats["actor/rollout_is_max"],) = self.dp_max([is_max])
        return stats
