"""The output head of the causal LMs we train: a Linear that can score labels without forming logits.

HF's causal-LM forward ends in ``logits = self.lm_head(hidden[:, keep])``. Training needs only the
log-probs of the response tokens at those positions, so inside `LogProbHead.scoring` the head returns
them (and the entropy) from the fused projection + log-softmax of `algorithms.logprob`, and no
``[N, V]`` logits exist. It runs inside the model's forward, so FSDP2 has the weight gathered and
accounts its gradient as for any parameter. Outside `scoring` it is an ordinary ``nn.Linear``.

Under tensor parallelism its weight is a DTensor split by vocabulary rows (``Shard(0)``; tied models
share it with the embedding): scoring stays vocab-parallel, and plain logits are gathered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchrlhf.algorithms.logprob import log_probs_from_hidden


@dataclass
class _Request:
    labels: torch.Tensor
    temperature: float
    entropy_grad: bool


class LogProbHead(nn.Linear):
    """``lm_head`` of a training causal LM (no bias; the weight may be tied to the input embedding)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self._request: _Request | None = None
        self.compile = False  # scoring's tile arithmetic through torch.compile (`compile_blocks` sets it)
        # scoring's tiles (positions, vocabulary rows); None: `algorithms.logprob.tile_sizes` of the input's
        # device. The memory trace (`trainer.memory`) runs on fake CPU tensors and sets the target device's.
        self.tiles: tuple[int, int] | None = None

    @classmethod
    def install(cls, model: nn.Module) -> LogProbHead:
        """Replace ``model``'s output Linear by a LogProbHead over the same weight Parameter (ties kept)."""
        old = model.get_output_embeddings()
        if isinstance(old, cls):
            return old
        if type(old) is not nn.Linear or old.bias is not None:
            raise ValueError(f"{type(model).__name__}: expected a bias-free nn.Linear lm_head, got {old!r}")
        head = cls(old.in_features, old.out_features, device="meta")
        head.weight = old.weight
        model.set_output_embeddings(head)
        return head

    @contextmanager
    def scoring(self, labels: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = True) -> Iterator[None]:
        """Within this block the next forward returns ``[..., 2]``: (log p(labels), entropy) per position.

        ``labels`` has the shape of the head's input without its last dim (the positions kept). With
        ``entropy_grad=False`` the entropy is returned detached: stacked with the log-probs it would
        otherwise receive a zero gradient, and its backward terms cost half the head's backward passes.
        """
        self._request = _Request(labels, temperature, entropy_grad)
        try:
            yield
        finally:
            self._request = None

    def _local_weight(self) -> tuple[torch.Tensor, torch.distributed.ProcessGroup | None, int]:
        """(this rank's weight rows, the TP group or None, the vocabulary index of its first row)."""
        w = self.weight
        if not isinstance(w, DTensor):
            return w, None, 0
        if w.device_mesh.ndim != 1 or w.placements != (Shard(0),):
            raise ValueError(f"LogProbHead: expected the weight sharded by vocab rows on a 1-D mesh, "
                             f"got {w.placements} on {w.device_mesh}")
        _, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        return w.to_local(), w.device_mesh.get_group(), offset[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request, self._request = self._request, None  # one forward per `scoring` block
        if request is None and hidden.shape[-2] == 0:
            # No position kept (a shared-prefix pass wants only its keys/values). The empty output still
            # leads back to ``hidden``, so backward enters the blocks, but not through the weight, whose
            # backward would allocate and add a zero [V, D] gradient. Cloned (it is empty): FSDP2 warns when a
            # root module returns a view.
            return hidden[..., :1].expand(*hidden.shape[:-1], self.out_features).clone()
        if request is None:
            if not isinstance(self.weight, DTensor):
                return F.linear(hidden, self.weight)
            # replicated input (its gradient is all-reduced in backward), vocab-sharded logits, gathered
            hidden = DTensor.from_local(hidden, self.weight.device_mesh, [Replicate()], run_check=False)
            return F.linear(hidden, self.weight).full_tensor()
        weight, group, vocab_start = self._local_weight()
        chunk_size, vocab_chunk_size = self.tiles or (None, None)
        log_probs, entropy = log_probs_from_hidden(hidden, weight, request.labels, request.temperature,
                                                   chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size,
                                                   group=group, vocab_start=vocab_start, compile=self.compile)
        return torch.stack([log_probs, entropy if request.entropy_grad else entropy.detach()], dim=-1)
