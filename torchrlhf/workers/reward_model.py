"""A scalar-head model that scores whole responses: the reward model, or (``output_key="cost_scores"``) a cost model."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchrlhf.data import Batch
from torchrlhf.models.heads import score_at_last_token
from torchrlhf.runtime.worker import Dispatch, register
from torchrlhf.workers.base import FSDPWorker, MemorySaving, resolve_dtype
from torchrlhf.workers.microbatch import trimmed_inputs


def last_token_scores(model: torch.nn.Module, mb: Batch) -> torch.Tensor:
    """The head's output at each row's last attended token (the end of its response), ``[b]``."""
    width = mb["responses"].shape[1] if "responses" in mb else 0
    inp = trimmed_inputs(mb, width)
    out = model(input_ids=inp.input_ids, attention_mask=inp.attention_mask, position_ids=inp.position_ids)
    if isinstance(out, DTensor):
        out = out.full_tensor()
    return score_at_last_token(out, inp.attention_mask).float()


class RewardModelWorker(FSDPWorker):
    """Frozen FSDP2 scorer; inputs must be tokenized with the scorer's tokenizer (same as the policy's here)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        output_key: str = "rm_scores",
        micro_batch_size_per_device: int = 8,
        use_dynamic_bsz: bool = False,
        max_tokens_per_micro_batch: int | None = None,
        tp_size: int = 1,
        cpu_offload: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(tp_size=tp_size, seed=seed)
        if use_dynamic_bsz and not max_tokens_per_micro_batch:
            raise ValueError("reward_model.use_dynamic_bsz needs max_tokens_per_micro_batch > 0")
        if micro_batch_size_per_device <= 0:
            raise ValueError(f"reward_model.micro_batch_size_per_device must be positive, got {micro_batch_size_per_device}")
        self.output_key = output_key
        self.micro_batch_size = micro_batch_size_per_device
        self.max_tokens = max_tokens_per_micro_batch if use_dynamic_bsz else None
        self.model = self._build_model(model_path, resolve_dtype(dtype), value_head=True, freeze=True,
                                       memory=MemorySaving(cpu_offload=cpu_offload))
        self.model.eval()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_scores(self, batch: Batch) -> Batch:
        """``{output_key} [B]``: the score at each sequence's last valid token."""
        outs = self.map_micro_batches(
            batch, lambda mb, rows: {self.output_key: last_token_scores(self.model, mb)},
            micro_batch_size=self.micro_batch_size, max_tokens=self.max_tokens,
        )
        return Batch(outs, meta=batch.meta)
