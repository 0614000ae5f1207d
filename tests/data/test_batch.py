"""Unit tests for every Batch operation, against hand-written expected values."""

from __future__ import annotations

import pickle

import pytest
import torch

from torchrlhf.data.batch import Batch, collate


def make(n: int = 4) -> Batch:
    return Batch(
        {"x": torch.arange(n), "m": torch.arange(2 * n).view(n, 2)},
        {"s": [f"s{i}" for i in range(n)]},
        {"temperature": 0.7},
    )


def test_construction_and_size_checks() -> None:
    b = make()
    assert len(b) == b.batch_size == 4 and b.keys() == ["x", "m", "s"] and "s" in b and "y" not in b
    assert len(Batch()) == 0 and len(Batch(non_tensors={"s": ["a", "b"]})) == 2
    with pytest.raises(ValueError, match="disagree"):
        Batch({"x": torch.zeros(3)}, {"s": ["a"]})
    with pytest.raises(ValueError, match="scalar"):
        Batch({"x": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="both"):
        Batch({"x": torch.zeros(1)}, {"x": ["a"]})
    d = Batch.from_dict({"x": torch.ones(2), "s": ["a", "b"]}, meta={"k": 1})
    assert d.tensors.keys() == {"x"} and d.non_tensors == {"s": ["a", "b"]} and d.meta == {"k": 1}


def test_column_access_set_get_pop() -> None:
    b = make()
    assert b["x"].tolist() == [0, 1, 2, 3] and b["s"][1] == "s1"
    with pytest.raises(KeyError, match="no column 'y'"):
        b["y"]
    b["y"] = torch.ones(4)
    b["t"] = ("a", "b", "c", "d")
    assert b["t"] == ["a", "b", "c", "d"]
    b["x"] = ["now", "a", "list", "!"]  # a column may switch kind
    assert "x" in b.non_tensors and "x" not in b.tensors
    with pytest.raises(ValueError, match="batch has 4"):
        b["z"] = torch.ones(3)
    with pytest.raises(ValueError, match="batch has 4"):
        b["z"] = ["a"]
    assert b.get("nope", 5) == 5 and b.get("t") == ["a", "b", "c", "d"]
    assert b.pop("y").tolist() == [1.0] * 4 and "y" not in b
    with pytest.raises(KeyError):
        b.pop("y")


def test_indexing() -> None:
    b = make()
    one = b[2]
    assert len(one) == 1 and one["x"].tolist() == [2] and one["s"] == ["s2"] and one.meta == {"temperature": 0.7}
    assert b[-1]["x"].tolist() == [3] and b[-4]["x"].tolist() == [0]
    with pytest.raises(IndexError):
        b[4]
    with pytest.raises(IndexError):
        b[-5]
    assert b[1:3]["s"] == ["s1", "s2"] and b[1:3]["m"].tolist() == [[2, 3], [4, 5]]
    assert b[[3, 0]]["s"] == ["s3", "s0"] and b[torch.tensor([3, 0])]["x"].tolist() == [3, 0]
    masked = b[torch.tensor([True, False, False, True])]
    assert masked["s"] == ["s0", "s3"] and masked["x"].tolist() == [0, 3]
    with pytest.raises(IndexError, match="mask"):
        b[torch.tensor([True, False])]
    assert len(b[[]]) == 0


def test_split_and_chunk() -> None:
    b = make(5)
    assert [p["x"].tolist() for p in b.split(2)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError):
        b.split(0)
    with pytest.raises(ValueError, match="pad=True"):
        b.chunk(2)
    pieces = b.chunk(2, pad=True)  # 5 -> 6: sample 0 repeated at the end
    assert [p["x"].tolist() for p in pieces] == [[0, 1, 2], [3, 4, 0]]
    assert [p["s"] for p in pieces] == [["s0", "s1", "s2"], ["s3", "s4", "s0"]]
    assert all(p.meta == {"temperature": 0.7, "pad_size": 1} for p in pieces)
    assert "pad_size" not in b.meta
    assert [p["x"].tolist() for p in make(4).chunk(2)] == [[0, 1], [2, 3]]
    assert [len(p) for p in Batch({"x": torch.zeros(0)}).chunk(3)] == [0, 0, 0]


def test_pad_to_multiple_and_unpad() -> None:
    b = make(2)
    padded, pad = b.pad_to_multiple(5)  # 2 -> 5: samples 0,1,0 appended
    assert pad == 3 and padded["x"].tolist() == [0, 1, 0, 1, 0] and padded["s"] == ["s0", "s1", "s0", "s1", "s0"]
    assert padded.unpad(pad) == b
    same, zero = b.pad_to_multiple(2)
    assert zero == 0 and same is b and b.unpad(0) is b
    assert Batch({"x": torch.zeros(0)}).pad_to_multiple(2)[1] == 0  # 0 is a multiple of anything
    with pytest.raises(ValueError, match="positive"):
        b.pad_to_multiple(0)


def test_concat() -> None:
    a, b = make(2), make(3)
    c = Batch.concat([a, b])
    assert c["x"].tolist() == [0, 1, 0, 1, 2] and c["s"] == ["s0", "s1", "s0", "s1", "s2"] and c.meta == a.meta
    with pytest.raises(ValueError, match="column sets differ"):
        Batch.concat([a, a.select("x")])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


def test_repeat() -> None:
    b = make(2)
    assert b.repeat(3)["x"].tolist() == [0, 0, 0, 1, 1, 1]
    assert b.repeat(2, interleave=False)["s"] == ["s0", "s1", "s0", "s1"]
    assert b.repeat(2)["m"].tolist() == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_union() -> None:
    a = make(2)
    other = Batch({"x": torch.arange(2), "y": torch.ones(2)}, {"u": ["p", "q"]}, {"step": 1})
    u = a.union(other)
    assert set(u.keys()) == {"x", "m", "s", "y", "u"} and u.meta == {"temperature": 0.7, "step": 1}
    with pytest.raises(ValueError, match="'x' differs"):
        a.union(Batch({"x": torch.tensor([5, 6])}))
    with pytest.raises(ValueError, match="'s' differs"):
        a.union(Batch(non_tensors={"s": ["no", "pe"]}))
    with pytest.raises(ValueError, match="size 2 and 3"):
        a.union(make(3))


def test_select_to_copy() -> None:
    b = make()
    s = b.select("x", "s")
    assert s.keys() == ["x", "s"] and s.meta == b.meta and b.select("x", meta=False).meta == {}
    with pytest.raises(KeyError, match="nope"):
        b.select("x", "nope")
    moved = b.to("cpu")
    assert moved == b and moved is not b
    c = b.copy()
    c["new"] = torch.zeros(4)
    c.meta["k"] = 1
    c["s"].append("not in b")  # column lists are copied too
    assert "new" not in b and "k" not in b.meta and len(b["s"]) == 4
    assert c["x"] is b["x"]  # shallow: tensors are shared


def test_iter_samples_and_collate() -> None:
    b = make(2)
    rows = list(b.iter_samples())
    assert rows[1]["x"].item() == 1 and rows[1]["s"] == "s1" and rows[1]["m"].tolist() == [2, 3]
    assert collate(rows, meta=b.meta) == b
    assert len(collate([])) == 0


def test_pickle_roundtrip_and_compact_views() -> None:
    b = make()
    back = pickle.loads(pickle.dumps(b))
    assert back == b and back["x"].dtype == torch.int64
    big = Batch({"x": torch.zeros(1000, 250)})  # 1 MB of float32
    shard = big[0:10]
    assert len(pickle.dumps(shard)) < 20_000  # a slice does not drag its parent's storage along
    strided = Batch({"x": torch.arange(12).view(3, 4).t()})
    assert pickle.loads(pickle.dumps(strided))["x"].tolist() == torch.arange(12).view(3, 4).t().tolist()


def test_equality_and_repr() -> None:
    assert make() == make() and make() != make(3) and make() != "x"
    other = make()
    other.meta["k"] = 1
    assert make() != other
    assert "Batch(size=4" in repr(make())
