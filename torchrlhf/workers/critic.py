"""The value role: per-token values of responses and clipped value-loss updates."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor

from torchrlhf.algorithms import compute_value_loss
from torchrlhf.data import Batch
from torchrlhf.models.packed_attention import PrefixKV, sliding_window
from torchrlhf.runtime.worker import Dispatch, register
from torchrlhf.workers.base import FSDPWorker, resolve_dtype
from torchrlhf.workers.microbatch import pad_response_columns, trimmed_inputs, validate_batch_sizes
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, run_prefixes, scatter_responses, suffix_forward


def response_values(model: torch.nn.Module, mb: Batch) -> torch.Tensor:
    """Values ``[b, R]`` at the positions that predict each response token (the token before it).

    Runs on the micro-batch trimmed of all-padding columns; zero-padded back to the response width.
    """
    width = mb["responses"].shape[1]
    inp = trimmed_inputs(mb, width)
    values = model(input_ids=inp.input_ids, attention_mask=inp.attention_mask, position_ids=inp.position_ids)
    if isinstance(values, DTensor):
        values = values.full_tensor()
    total = values.shape[1]
    return pad_response_columns(values[:, total - inp.response_len - 1 : total - 1].float(), width)


class CriticWorker(FSDPWorker):
    """FSDP2 (× TP) value model. Arguments mirror the ``critic`` config section (flat keys).

    Batch-size semantics match `ActorWorker` (global, in prompts), and so does ``shared_prefix``:
    each distinct prompt runs once per mini-batch, responses are packed without padding.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        lr: float = 1e-5,
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
        ppo_epochs: int = 1,
        cliprange_value: float = 0.5,
        loss_agg_mode: str = "token-mean",
        use_dynamic_bsz: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        init_head_std: float | None = None,
        tp_size: int = 1,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        shared_prefix: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(tp_size=tp_size, seed=seed)
        validate_batch_sizes(
            ppo_mini_batch_size=ppo_mini_batch_size, rollout_n=rollout_n, dp_size=self.dp_size,
            ppo_micro_batch_size_per_device=ppo_micro_batch_size_per_device, use_dynamic_bsz=use_dynamic_bsz,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch, role="critic",
        )
        if ppo_epochs <= 0:
            raise ValueError(f"critic.ppo_epochs must be positive, got {ppo_epochs}")
        self.grad_clip = grad_clip
        self.ppo_mini_batch_size = ppo_mini_batch_size
        self.rollout_n = rollout_n
        self.micro_batch_size = ppo_micro_batch_size_per_device
        self.ppo_epochs = ppo_epochs
        self.cliprange_value = cliprange_value
        self.loss_agg_mode = loss_agg_mode
        self.max_tokens = max_tokens_per_micro_batch if use_dynamic_bsz else None
        self.shared_prefix = shared_prefix

        self.model = self._build_model(model_path, resolve_dtype(dtype), value_head=True,
                                       activation_checkpointing=activation_checkpointing, cpu_offload=cpu_offload,
                                       init_head_std=init_head_std)
        self.window = sliding_window(self.model.config)
        self._init_optimizer(lr=lr, weight_decay=weight_decay, betas=betas, warmup_steps=warmup_steps,
                             total_steps=total_steps, lr_scheduler=lr_scheduler, min_lr_ratio=min_lr_ratio)

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_values(self, batch: Batch) -> Batch:
        """``values [B,R]`` (0 on response padding columns beyond the micro-batch's longest response)."""
        self.model.eval()
        plan = prefix = lengths = None
        if self.shared_prefix:
            with torch.no_grad():
                plan, prefix, lengths = run_prefixes(self.model, batch, self.window, self.device)

        def fn(mb: Batch, rows: list[int]) -> dict[str, torch.Tensor]:
            values = self._values(mb, rows, plan, prefix)
            return {"values": values * mb["response_mask"].to(values.dtype)}

        outs = self.map_micro_batches(batch, fn, micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens,
                                      lengths=lengths)
        return Batch(outs, meta=batch.meta)

    def _values(self, mb: Batch, rows: list[int], plan: SharedPrefixPlan | None, prefix: PrefixKV | None):
        """Values ``[b, R]`` of micro-batch ``mb`` (rows ``rows`` of the planned batch when sharing prefixes)."""
        if plan is None:
            return response_values(self.model, mb)
        row = plan.suffix_row(rows, prefix, self.device)
        values = suffix_forward(self.model, row)
        if isinstance(values, DTensor):
            values = values.full_tensor()
        return scatter_responses(values.float(), row, len(rows), mb["responses"].shape[1])

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value loss over ppo epochs × mini-batches × micro-batches (see `ActorWorker.update`)."""
        num_mini = self.check_local_batch(batch, ppo_mini_batch_size=self.ppo_mini_batch_size,
                                          rollout_n=self.rollout_n, role="critic")
        missing = [k for k in ("responses", "input_ids", "attention_mask", "response_mask", "values", "returns")
                   if k not in batch]
        if missing:
            raise KeyError(f"critic.update: batch lacks columns {missing}; it has {batch.keys()}")
        lr = self.current_lr
        self.model.train()
        sums: dict[str, list[float]] = defaultdict(list)
        skipped = 0
        for _ in range(self.ppo_epochs):
            for mini in self.mini_batches(batch, num_mini):
                stats = self._train_mini_batch(mini)
                grad_norm, skip = self.optimizer_step(self.grad_clip)
                skipped += int(skip)
                if not skip:
                    stats["critic/grad_norm"] = grad_norm
                for k, v in stats.items():
                    sums[k].append(v)
        self.lr_scheduler.step()
        metrics = {k: sum(v) / len(v) for k, v in sums.items()}
        metrics["critic/lr"] = lr
        metrics["critic/grad_norm_nonfinite"] = float(skipped > 0)
        metrics["critic/skipped_steps"] = float(skipped)
        return metrics

    def _train_mini_batch(self, mini: Batch) -> dict[str, float]:
        mini_mask = mini["response_mask"]
        tokens, seqs = self.dp_sum([float(mini_mask.sum()), float((mini_mask.sum(-1) > 0).sum())])
        normalizer = tokens if self.loss_agg_mode == "token-mean" else seqs
        local: dict[str, float] = defaultdict(float)
        plan = prefix = lengths = None
        if self.shared_prefix:  # prompts forward once here, backward once after the micro-batches
            plan, prefix, lengths = run_prefixes(self.model, mini, self.window, self.device)
        for mb, index in self.micro_batches(mini, micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens,
                                            lengths=lengths):
            vpreds = self._values(mb, [0] if index is None else index.tolist(), plan, prefix)
            mask = mb["response_mask"].to(vpreds.dtype)
            loss, clipfrac = compute_value_loss(
                vpreds, mb["values"], mb["returns"], mask, cliprange_value=self.cliprange_value,
                loss_agg_mode=self.loss_agg_mode, normalizer=normalizer,
            )
            weight = 0.0 if index is None else 1.0  # filler micro-batches only keep collectives in step
            (loss * (weight * self.dp_size)).backward()
            if index is None:
                continue
            share = float(mask.sum()) / max(tokens, 1.0)
            local["critic/vf_loss"] += float(loss.detach())
            local["critic/vf_clipfrac"] += float(clipfrac) * share
            local["critic/vpred_mean"] += float((vpreds.detach() * mask).sum()) / max(tokens, 1.0)
        if prefix is not None:
            prefix.backward()
        keys = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"]
        return dict(zip(keys, self.dp_sum([local[k] for k in keys])))
