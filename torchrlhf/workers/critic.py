"""The value role: per-token values of responses and clipped value-loss updates."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from torchrlhf.algorithms import ValueLoss, compute_value_loss
from torchrlhf.config import as_section
from torchrlhf.data import Batch
from torchrlhf.models.packed_attention import PrefixKV, sliding_window
from torchrlhf.runtime.worker import Dispatch, register
from torchrlhf.workers.base import FSDPWorker, MemorySaving, MiniBatchTotals, TrainingRun, resolve_dtype
from torchrlhf.workers.microbatch import Batching, pad_response_columns, trimmed_inputs
from torchrlhf.workers.shared_prefix import SharedPrefixPlan, scatter_responses, suffix_forward


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
    """FSDP2 (× TP) value model. Arguments mirror the ``critic`` config section.

    ``optim`` and ``batching`` mean what they mean for `ActorWorker` (batch sizes global, in prompts), and
    so do ``shared_prefix`` (each distinct prompt runs once per mini-batch, responses are packed without
    padding), ``memory`` (`MemorySaving`) and ``run`` (`TrainingRun`). ``loss`` (`ValueLoss`): the value clip and the aggregation.
    """

    role = "critic"
    OPTIM_DEFAULTS = {"lr": 1e-5, "weight_decay": 0.01}
    loss_metrics = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean")

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        optim: dict[str, Any] | None = None,
        batching: Batching | None = None,
        run: TrainingRun = TrainingRun(),
        loss: ValueLoss = ValueLoss(),
        init_head_std: float | None = None,
        tp_size: int = 1,
        memory: MemorySaving = MemorySaving(),
        compile: bool = False,
        shared_prefix: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(tp_size=tp_size, seed=seed)
        self.loss = as_section(ValueLoss, loss)
        memory = as_section(MemorySaving, memory)
        self._set_shared_prefix(shared_prefix, memory)
        self.model = self._build_model(model_path, resolve_dtype(dtype), value_head=True, memory=memory,
                                       init_head_std=init_head_std, compile=compile)
        self.window = sliding_window(self.model.config)
        self._init_training(optim=optim, batching=batching, run=as_section(TrainingRun, run),
                            loss_agg_mode=self.loss.agg_mode)

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
    def compute_values(self, batch: Batch) -> Batch:
        """``values [B,R]`` (0 on response padding columns beyond the micro-batch's longest response)."""
        def fn(mb: Batch, rows: list[int], plan, prefix) -> dict[str, torch.Tensor]:
            values = self._values(mb, rows, plan, prefix)
            return {"values": values * mb["response_mask"].to(values.dtype)}

        return self.infer(batch, fn, "values")

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch: Batch) -> dict[str, float]:
        """Clipped value loss over the rollout (`FSDPWorker.train`)."""
        return self.train(batch, needs=["responses", "input_ids", "attention_mask", "response_mask", "values",
                                        "returns"])

    def micro_batch_loss(self, mb: Batch, rows: list[int], plan: SharedPrefixPlan | None, prefix: PrefixKV | None,
                         totals: MiniBatchTotals, *, real: bool) -> tuple[torch.Tensor, dict[str, float]]:
        vpreds = self._values(mb, rows, plan, prefix)
        mask = mb["response_mask"].to(vpreds.dtype)
        loss, clipfrac = compute_value_loss(
            vpreds, mb["values"], mb["returns"], mask, cliprange_value=self.loss.cliprange_value,
            loss_agg_mode=self.loss.agg_mode, normalizer=totals.normalizer,
        )
        tokens = max(totals.tokens, 1.0)
        share = float(mask.sum()) / tokens
        return loss, {"critic/vf_loss": float(loss.detach()), "critic/vf_clipfrac": float(clipfrac) * share,
                      "critic/vpred_mean": float((vpreds.detach() * mask).sum()) / tokens}
