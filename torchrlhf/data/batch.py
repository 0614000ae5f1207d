"""The batch container passed between the controller and the workers.

A `Batch` holds tensors that share a leading batch dimension, non-tensor columns
(lists of strings, ids, dicts: one entry per sample) and a `meta` dict of
batch-level values (sampling params, step number, ...). It is deliberately
plain PyTorch: pickling a Batch pickles its tensors as tensors, so RPC moves
them with torch's tensor serialisation instead of Python lists.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

Index = int | slice | Sequence[int] | torch.Tensor


class Batch:
    """Columns of per-sample data plus batch-level meta.

    Args:
        tensors: name -> tensor; every tensor has the same ``shape[0]``.
        non_tensors: name -> list with one entry per sample.
        meta: batch-level values, carried along by every operation.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Sequence[Any]] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, list[Any]] = {k: list(v) for k, v in (non_tensors or {}).items()}
        self.meta: dict[str, Any] = dict(meta or {})
        self._check_sizes()

    # ------------------------------------------------------------------ building
    @classmethod
    def from_dict(cls, columns: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> Batch:
        """Build from one mapping: tensors become tensor columns, everything else a list column."""
        tensors = {k: v for k, v in columns.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in columns.items() if not isinstance(v, torch.Tensor)}
        return cls(tensors, non_tensors, meta)

    def _check_sizes(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items() if v.dim() > 0}
        bad = [k for k, v in self.tensors.items() if v.dim() == 0]
        if bad:
            raise ValueError(f"Batch tensors need a leading batch dimension; scalar columns: {bad}")
        sizes.update({k: len(v) for k, v in self.non_tensors.items()})
        overlap = set(self.tensors) & set(self.non_tensors)
        if overlap:
            raise ValueError(f"columns {sorted(overlap)} are both tensor and non-tensor columns")
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns disagree on the batch size: {sizes}")

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.non_tensors.values():
            return len(v)
        return 0

    @property
    def batch_size(self) -> int:
        return len(self)

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, index: str | Index) -> Any:
        if isinstance(index, str):
            if index in self.tensors:
                return self.tensors[index]
            if index in self.non_tensors:
                return self.non_tensors[index]
            raise KeyError(f"no column {index!r} in Batch; columns: {self.keys()}")
        return self._take(index)

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a column; its length must match the batch."""
        n = len(self) if self.keys() else None
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or (n is not None and value.shape[0] != n):
                raise ValueError(f"column {key!r} has leading size {tuple(value.shape)[:1]}, batch has {n}")
            self.non_tensors.pop(key, None)
            self.tensors[key] = value
        else:
            value = list(value)
            if n is not None and len(value) != n:
                raise ValueError(f"column {key!r} has {len(value)} entries, batch has {n}")
            self.tensors.pop(key, None)
            self.non_tensors[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def pop(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors.pop(key)
        if key in self.non_tensors:
            return self.non_tensors.pop(key)
        raise KeyError(f"no column {key!r} in Batch; columns: {self.keys()}")

    def _take(self, index: Index) -> Batch:
        if isinstance(index, int):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"index {index} out of range for a Batch of size {n}")
            index %= n
            index = slice(index, index + 1)
        if isinstance(index, slice):
            tensors = {k: v[index] for k, v in self.tensors.items()}
            non_tensors = {k: v[index] for k, v in self.non_tensors.items()}
        else:
            idx = torch.as_tensor(index, dtype=torch.long) if not isinstance(index, torch.Tensor) else index
            if idx.dtype == torch.bool:
                if idx.shape != (len(self),):
                    raise IndexError(f"boolean mask of shape {tuple(idx.shape)} for a Batch of size {len(self)}")
                idx = idx.nonzero().flatten()
            idx = idx.to("cpu", torch.long).flatten()
            tensors = {k: v[idx.to(v.device)] for k, v in self.tensors.items()}
            positions = idx.tolist()
            non_tensors = {k: [v[i] for i in positions] for k, v in self.non_tensors.items()}
        return Batch(tensors, non_tensors, self.meta)

    # ------------------------------------------------------------------ reshaping
    def split(self, size: int) -> list[Batch]:
        """Consecutive pieces of ``size`` samples (the last may be shorter)."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self[i : i + size] for i in range(0, len(self), size)]

    def chunk(self, n: int, pad: bool = False) -> list[Batch]:
        """``n`` pieces of equal size.

        Without ``pad`` the batch size must divide by ``n``. With ``pad`` the batch
        is first padded (see `pad_to_multiple`); the pad count is in each piece's
        ``meta["pad_size"]`` of the whole batch so the caller can strip it later.
        """
        if n <= 0:
            raise ValueError(f"chunk count must be positive, got {n}")
        batch, pad_size = (self.pad_to_multiple(n) if pad else (self, 0))
        if len(batch) % n:
            raise ValueError(f"cannot chunk a batch of {len(batch)} into {n} equal pieces; use pad=True")
        pieces = batch.split(len(batch) // n) if len(batch) else [batch[0:0] for _ in range(n)]
        if pad:
            for p in pieces:
                p.meta["pad_size"] = pad_size
        return pieces

    def pad_to_multiple(self, multiple: int) -> tuple[Batch, int]:
        """Repeat leading samples so the size divides by ``multiple``; returns (batch, pad_size)."""
        if multiple <= 0:
            raise ValueError(f"pad multiple must be positive, got {multiple}")
        n = len(self)
        pad_size = (-n) % multiple
        if pad_size == 0:
            return self, 0
        if n == 0:
            raise ValueError("cannot pad an empty batch")
        idx = torch.arange(pad_size) % n
        return Batch.concat([self, self[idx]]), pad_size

    def unpad(self, pad_size: int) -> Batch:
        return self[: len(self) - pad_size] if pad_size else self

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Concatenate along the batch dimension; columns must match; meta of the first wins."""
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one Batch")
        first = batches[0]
        for b in batches[1:]:
            if set(b.tensors) != set(first.tensors) or set(b.non_tensors) != set(first.non_tensors):
                raise ValueError(f"concat: column sets differ: {sorted(first.keys())} vs {sorted(b.keys())}")
        tensors = {}
        for k in first.tensors:
            shapes = {tuple(b.tensors[k].shape[1:]) for b in batches}
            if len(shapes) > 1:
                raise ValueError(f"concat: column {k!r} has different shapes past the batch dimension: {sorted(shapes)}")
            tensors[k] = torch.cat([b.tensors[k] for b in batches])
        non_tensors = {k: [x for b in batches for x in b.non_tensors[k]] for k in first.non_tensors}
        return Batch(tensors, non_tensors, first.meta)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Repeat every sample ``n`` times: ``aabb`` when interleaved, ``abab`` otherwise."""
        size = len(self)
        if interleave:
            idx = torch.arange(size).repeat_interleave(n)
        else:
            idx = torch.arange(size).repeat(n)
        return self[idx]

    def union(self, other: Batch) -> Batch:
        """Columns of both; shared columns must hold equal values."""
        if self.keys() and other.keys() and len(self) != len(other):
            raise ValueError(f"union of batches of size {len(self)} and {len(other)}")
        tensors = dict(self.tensors)
        for k, v in other.tensors.items():
            if k in tensors and not (tensors[k].shape == v.shape and torch.equal(tensors[k].cpu(), v.cpu())):
                raise ValueError(f"union: column {k!r} differs between the two batches")
            tensors[k] = v
        non_tensors = dict(self.non_tensors)
        for k, v in other.non_tensors.items():
            if k in non_tensors and non_tensors[k] != v:
                raise ValueError(f"union: column {k!r} differs between the two batches")
            non_tensors[k] = v
        meta = {**self.meta, **other.meta}
        return Batch(tensors, non_tensors, meta)

    def select(self, *keys: str, meta: bool = True) -> Batch:
        """A batch with only ``keys`` (missing keys are an error)."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"select: no columns {missing}; columns: {self.keys()}")
        return Batch(
            {k: self.tensors[k] for k in keys if k in self.tensors},
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            self.meta if meta else None,
        )

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.non_tensors, self.meta)

    def copy(self) -> Batch:
        """Shallow copy: new column dicts, same tensors."""
        return Batch(self.tensors, self.non_tensors, copy.copy(self.meta))

    def iter_samples(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            row = {k: v[i] for k, v in self.tensors.items()}
            row.update({k: v[i] for k, v in self.non_tensors.items()})
            yield row

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        # Tensors go as tensors; make them contiguous and on CPU so RPC's tensor
        # pickler sends compact buffers and the receiver need not own our device.
        # A slice (e.g. one DP shard) shares its parent's storage, and pickling a
        # tensor sends its whole storage: copy such views to their own storage.
        return {
            "tensors": {k: _compact(v.detach().cpu().contiguous()) for k, v in self.tensors.items()},
            "non_tensors": self.non_tensors,
            "meta": self.meta,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = state["tensors"]
        self.non_tensors = state["non_tensors"]
        self.meta = state["meta"]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Batch):
            return NotImplemented
        return (
            set(self.tensors) == set(other.tensors)
            and all(torch.equal(self.tensors[k].cpu(), other.tensors[k].cpu()) for k in self.tensors)
            and self.non_tensors == other.non_tensors
            and self.meta == other.meta
        )

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {tuple(v.shape)} {v.dtype}" for k, v in self.tensors.items())
        other = ", ".join(f"{k}: list" for k in self.non_tensors)
        return f"Batch(size={len(self)}, {cols}{', ' if other and cols else ''}{other}, meta={list(self.meta)})"


def _compact(t: torch.Tensor) -> torch.Tensor:
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def collate(rows: Iterable[Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> Batch:
    """Stack per-sample dicts into a Batch (tensors must share shapes)."""
    rows = list(rows)
    if not rows:
        return Batch(meta=meta)
    columns: dict[str, Any] = {}
    for key in rows[0]:
        values = [r[key] for r in rows]
        columns[key] = torch.stack(values) if isinstance(values[0], torch.Tensor) else values
    return Batch.from_dict(columns, meta)
