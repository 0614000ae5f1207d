"""Prompt datasets, a resumable sampler, and the collate that builds prompt `Batch`es.

Rows are read from jsonl or parquet files. Each row holds

- the prompt under ``prompt_key``: a string, or chat messages ``[{"role": ..., "content": ...}]``;
- the reference answer: ``reward_model.ground_truth`` (verl format), ``ground_truth`` or ``answer``;
- ``data_source`` (which reward function scores it), e.g. ``"openai/gsm8k"``.

Prompts are tokenized once, up front, so prompts longer than ``max_prompt_length`` can be
dropped and counted before training starts.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchrlhf.data.batch import Batch

log = logging.getLogger(__name__)


def read_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All rows of a ``.jsonl`` / ``.json`` (list of objects) / ``.parquet`` file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"dataset file not found: {path}")
    if path.endswith(".parquet"):
        try:  # imported here: pyarrow is optional, needed for parquet files only
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        return pq.read_table(path).to_pylist()
    if path.endswith(".jsonl"):
        rows = []
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        return rows
    if path.endswith(".json"):
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            raise ValueError(f"{path}: a .json dataset must be a list of objects")
        return rows
    raise ValueError(f"unsupported dataset file {path}: use .jsonl, .json or .parquet")


def reference(row: Mapping[str, Any]) -> Any:
    """A row's reference answer as written: ``reward_model.ground_truth``, else ``ground_truth``, else ``answer``."""
    reward_model = row.get("reward_model")
    if isinstance(reward_model, Mapping) and reward_model.get("ground_truth") is not None:
        return reward_model["ground_truth"]
    return row["ground_truth"] if row.get("ground_truth") is not None else row.get("answer")


def _ground_truth(row: Mapping[str, Any]) -> str | None:
    value = reference(row)
    if value is None or isinstance(value, str):
        return value
    # Structured references (countdown's {"target", "numbers"}) travel as JSON text: the column is str.
    return json.dumps(value) if isinstance(value, (Mapping, list)) else str(value)


class PromptDataset:
    """Tokenized prompts with their reference answers.

    Args:
        paths: one file or several (concatenated in order).
        tokenizer: a Hugging Face tokenizer.
        prompt_key: the column with the prompt string or chat messages.
        max_prompt_length: prompts with more tokens are dropped (``num_filtered`` counts them).
        apply_chat_template: format with the tokenizer's chat template (a string prompt becomes
            one user message) and add the assistant generation prompt.
        system_prompt: prepended as a system message when the chat has none (chat template only).
        default_data_source: ``data_source`` for rows without one.
        max_samples: keep only the first ``max_samples`` rows (before filtering).

    Item ``i`` is a dict: ``input_ids`` (list of ints), ``raw_prompt`` (the prompt text that
    ``input_ids`` encode), ``messages`` (the chat it was rendered from), ``ground_truth`` (as text),
    ``data_source``, ``index`` (row position in the files), ``row`` (the row as read: every column, values
    unchanged) and, when the row has one, ``max_tokens``.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        tokenizer: Any,
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        apply_chat_template: bool = True,
        system_prompt: str | None = None,
        default_data_source: str = "unknown",
        max_samples: int | None = None,
    ) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        rows: list[dict[str, Any]] = []
        for p in paths:
            rows.extend(read_rows(p))
        if max_samples is not None:
            rows = rows[:max_samples]
        if not rows:
            raise ValueError(f"dataset {[os.fspath(p) for p in paths]} has no rows")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length

        chats = [self._prompt_messages(row, i, prompt_key, apply_chat_template, system_prompt)
                 for i, row in enumerate(rows)]
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) if apply_chat_template
                 else m[0]["content"] for m in chats]
        # A chat template already contains the special tokens it needs; a raw string gets the tokenizer's.
        encoded = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]
        self.items: list[dict[str, Any]] = []
        lengths = []
        for i, (row, messages, text, ids) in enumerate(zip(rows, chats, texts, encoded)):
            lengths.append(len(ids))
            if len(ids) > max_prompt_length:
                continue
            item = {
                "input_ids": list(ids),
                "raw_prompt": text,
                "messages": messages,
                "ground_truth": _ground_truth(row),
                "data_source": row.get("data_source") or default_data_source,
                "index": i,
                "row": row,  # the row as read, every column: what an agent environment's reset gets
            }
            if row.get("max_tokens") is not None:  # a per-prompt response budget (below rollout.max_tokens)
                budget = row["max_tokens"]
                if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                    raise ValueError(f"row {i}: 'max_tokens' must be a positive integer, got {budget!r}")
                item["max_tokens"] = budget
            self.items.append(item)
        self.num_filtered = len(rows) - len(self.items)
        if not self.items:
            raise ValueError(
                f"all {len(rows)} prompts are longer than max_prompt_length={max_prompt_length} tokens "
                f"(shortest: {min(lengths)}); raise max_prompt_length"
            )
        if self.num_filtered:
            log.warning("dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                        self.num_filtered, len(rows), max_prompt_length)

    def _prompt_messages(self, row: Mapping[str, Any], i: int, key: str, chat: bool,
                         system_prompt: str | None) -> list[dict[str, str]]:
        """The row's prompt as chat messages (the system prompt first when configured and the chat has none)."""
        if key not in row:
            raise KeyError(f"row {i} has no prompt column {key!r}; columns: {sorted(row)}")
        prompt = row[key]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) and "role" in m and "content" in m
                                                  for m in prompt) and prompt:
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise ValueError(f"row {i}: {key!r} must be a string or a list of {{role, content}} messages, got {prompt!r}")
        if not chat:
            if not isinstance(prompt, str):
                raise ValueError(f"row {i}: chat messages need apply_chat_template=True")
            return messages
        if system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}, *messages]
        return messages

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.items[i]

    def collate(self, indices: Sequence[int]) -> Batch:
        """The prompt `Batch` of these dataset positions (see `collate_prompts`)."""
        return collate_prompts([self.items[i] for i in indices], pad_token_id=pad_token_id(self.tokenizer))


def pad_token_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token to pad prompts with")
    return pad


def collate_prompts(items: Sequence[Mapping[str, Any]], pad_token_id: int, pad_to: int | None = None) -> Batch:
    """Left-pad prompts into ``input_ids``/``attention_mask`` ``[B, P]`` plus the non-tensor columns.

    ``P`` is the longest prompt (or ``pad_to``). Each prompt gets a fresh ``uid`` (the group id that
    its ``n`` sampled responses will share).
    """
    if not items:
        raise ValueError("collate_prompts needs at least one item")
    width = max(len(it["input_ids"]) for it in items)
    if pad_to is not None:
        if pad_to < width:
            raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({width} tokens)")
        width = pad_to
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, it in enumerate(items):
        ids = it["input_ids"]
        if len(ids):
            input_ids[row, width - len(ids):] = torch.as_tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
    tensors = {"input_ids": input_ids, "attention_mask": attention_mask}
    if all("max_tokens" in it for it in items):
        tensors["max_tokens"] = torch.tensor([it["max_tokens"] for it in items], dtype=torch.long)
    rows = {"row": [it["row"] for it in items]} if all("row" in it for it in items) else {}
    return Batch(
        tensors,
        {
            **rows,  # the data rows as read (agent environments get them)
            "raw_prompt": [it["raw_prompt"] for it in items],
            "messages": [it.get("messages") for it in items],  # the chat an agent session starts from
            "ground_truth": [it.get("ground_truth") for it in items],
            "data_source": [it.get("data_source", "unknown") for it in items],
            "uid": [uuid.uuid4().hex for _ in items],
        },
    )


class StatefulSampler:
    """Batches of dataset positions, epoch after epoch, that can resume mid-epoch.

    Epoch ``e`` visits a permutation drawn from ``seed + e`` (or ``0..n-1`` without shuffle), so
    the order depends only on (seed, epoch) and ``state_dict()`` = (epoch, position) is enough
    to continue with the next unseen batch after a restart.
    """

    def __init__(self, dataset_len: int, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if dataset_len < (batch_size if drop_last else 1):
            raise ValueError(f"dataset of {dataset_len} prompts cannot fill one batch of {batch_size} (drop_last={drop_last})")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0  # batches already taken in this epoch
        self._cached: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.dataset_len, self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def _order(self, epoch: int) -> list[int]:
        if self._cached is None or self._cached[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_len, generator=g).tolist()
            else:
                order = list(range(self.dataset_len))
            self._cached = (epoch, order)
        return self._cached[1]

    def next_batch(self) -> list[int]:
        """The next batch of positions, moving on to the next epoch when this one is done."""
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        batch = self._order(self.epoch)[start : start + self.batch_size]
        self.position += 1
        return batch

    def __iter__(self):
        """The remaining batches of the current epoch (then the sampler stands at the next epoch)."""
        while self.position < len(self):
            yield self.next_batch()
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, int | bool]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "shuffle": self.shuffle,
                "dataset_len": self.dataset_len, "batch_size": self.batch_size, "drop_last": self.drop_last}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for key in ("dataset_len", "batch_size", "seed", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                    "resuming with different data or batch settings would not continue the same order"
                )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
