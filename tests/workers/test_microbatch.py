"""Micro-batch partitioning, padding trim and mini-batch assignment."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.data import Batch
from torchrlhf.workers.microbatch import (
    balanced_partition,
    micro_batch_groups,
    pad_response_columns,
    strided_mini_batches,
    token_budget_partition,
    trimmed_inputs,
)


def test_balanced_partition_covers_every_index_once_and_balances():
    lengths = [9, 8, 7, 6, 5, 4, 3, 2, 1, 1]
    groups = balanced_partition(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert max(sums) - min(sums) <= 1  # 46 tokens over 3 groups: 15/15/16


def test_token_budget_partition_respects_budget_with_fewest_groups():
    lengths = [7, 7, 7, 3, 3, 3]  # 30 tokens, budget 10 -> 3 groups of 7+3
    groups = token_budget_partition(lengths, 10)
    assert len(groups) == 3 and all(sum(lengths[i] for i in g) <= 10 for g in groups)
    with pytest.raises(ValueError, match="a sample has 12 tokens, more than max_tokens_per_micro_batch=10"):
        token_budget_partition([12, 1], 10)


def test_micro_batch_groups_fixed_size_without_group():
    assert micro_batch_groups([1] * 5, micro_batch_size=2, max_tokens=None, group=None) == [[0, 1], [2, 3], [4]]


def test_strided_mini_batches_do_not_depend_on_data_parallel_split():
    batch = Batch({"x": torch.arange(8)})
    whole = [m["x"].tolist() for m in strided_mini_batches(batch, 2)]
    shards = [strided_mini_batches(s, 2) for s in batch.chunk(2)]
    split = [sorted(shards[0][j]["x"].tolist() + shards[1][j]["x"].tolist()) for j in range(2)]
    assert whole == split == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_trimmed_inputs_cuts_all_padding_columns_only():
    # prompt width 4 (left-padded), response width 3 (right-padded)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 0]])
    batch = Batch({"input_ids": torch.arange(14).view(2, 7), "attention_mask": mask,
                   "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)})
    inp = trimmed_inputs(batch, response_width=3)
    assert inp.input_ids.tolist() == [[1, 2, 3, 4, 5], [8, 9, 10, 11, 12]]
    assert inp.response_len == 2
    assert inp.position_ids.tolist() == [[0, 0, 1, 2, 2], [0, 1, 2, 3, 4]]
    assert pad_response_columns(torch.ones(2, 2), 3).tolist() == [[1, 1, 0], [1, 1, 0]]
