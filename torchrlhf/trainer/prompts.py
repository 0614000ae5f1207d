"""Prompt batches for the controller: a `PromptDataset` walked by a resumable `StatefulSampler`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from torchrlhf.data import Batch
from torchrlhf.data.dataset import PromptDataset, StatefulSampler, pad_token_id


class PromptLoader:
    """Batches of ``batch_size`` prompts, epoch after epoch; ``state_dict`` resumes at the next unseen batch.

    Training loaders shuffle and drop the last partial batch (every step sees the same number of
    prompt groups); validation loaders walk the data in order and keep the remainder.
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.sampler = StatefulSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)

    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self.sampler)

    @property
    def pad_id(self) -> int:
        """The token prompts are left-padded with."""
        return pad_token_id(self.dataset.tokenizer)

    def next_batch(self) -> Batch:
        return self.dataset.collate(self.sampler.next_batch())

    def epoch(self) -> Iterator[Batch]:
        """One full pass from the start (for validation; it does not disturb a training position)."""
        for indices in StatefulSampler(len(self.dataset), self.batch_size, shuffle=False, drop_last=False):
            yield self.dataset.collate(indices)

    def decode(self, responses: torch.Tensor, response_mask: torch.Tensor, *, skip_special_tokens: bool = True
               ) -> list[str]:
        """Response texts (the tokens where ``response_mask`` is 1) for logging."""
        mask = response_mask.bool()
        ids = [responses[i][mask[i]].tolist() for i in range(len(responses))]
        return self.dataset.tokenizer.batch_decode(ids, skip_special_tokens=skip_special_tokens)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
