"""The traces kept on disk: read back on the next call, keyed by the model's config and the arguments, a corrupt file
traced again, and an empty ``TORCHRLHF_PLAN_CACHE`` keeps nothing."""

from __future__ import annotations

import json

import pytest

from torchrlhf.plan.memory import _step_memory
from torchrlhf.plan.trace_cache import ENV, cached


def _model(tmp_path, hidden: int):
    d = tmp_path / f"model_{hidden}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    return str(d)


class Counting:
    def __init__(self, value: float) -> None:
        self.calls, self.value = 0, value

    def __call__(self) -> dict[str, float]:
        self.calls += 1
        return {"activations": self.value, "parameters": 2.0}


def test_a_trace_is_read_back_and_keyed_by_config_and_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    model = _model(tmp_path, 64)
    trace = Counting(1.5)
    assert cached(model, "dense", ("train", 4), trace) == {"activations": 1.5, "parameters": 2.0}
    assert cached(model, "dense", ("train", 4), Counting(99.0)) == {"activations": 1.5, "parameters": 2.0}
    assert trace.calls == 1
    other_args, other_config = Counting(3.0), Counting(4.0)
    assert cached(model, "dense", ("train", 8), other_args)["activations"] == 3.0
    assert cached(_model(tmp_path, 128), "dense", ("train", 4), other_config)["activations"] == 4.0
    assert other_args.calls == other_config.calls == 1
    assert len(list((tmp_path / "cache").rglob("*.json"))) == 3


def test_a_corrupt_file_is_traced_again_and_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    model = _model(tmp_path, 64)
    cached(model, "dense", ("train", 4), Counting(1.5))
    (path,) = (tmp_path / "cache").rglob("*.json")
    path.write_text('{"activations": 1.')  # a torn write
    again = Counting(1.5)
    assert cached(model, "dense", ("train", 4), again)["activations"] == 1.5 and again.calls == 1
    assert json.loads(path.read_text()) == {"activations": 1.5, "parameters": 2.0}


def test_an_empty_setting_keeps_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, "")
    monkeypatch.chdir(tmp_path)
    model = _model(tmp_path, 64)
    trace = Counting(1.5)
    cached(model, "dense", ("train", 4), trace)
    cached(model, "dense", ("train", 4), trace)
    assert trace.calls == 2 and [p.name for p in tmp_path.rglob("*.json")] == ["config.json"]


def test_a_file_of_another_shape_is_traced_again(tmp_path, monkeypatch):
    """Valid JSON that is not a traced step (a hand edit, another version's layout) is refused by the reader and
    traced again; the planner's reader (`plan.memory._step_memory`) refuses each kind of wrong shape."""
    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    model = _model(tmp_path, 64)
    step = {"passes": {"activations": 1.0}, "optimizer": {}, "block_outputs": [{"activations": 0.5}], "offloaded": 0.0}
    assert cached(model, "dense", ("train", 4), lambda: step, read=_step_memory).passes == {"activations": 1.0}
    (path,) = (tmp_path / "cache").rglob("*.json")
    for wrong in ({"passes": 1}, {"activations": 1.5}, {**step, "passes": {"activations": "x"}},
                  {**step, "block_outputs": {"a": 1}}):
        path.write_text(json.dumps(wrong))
        with pytest.raises((TypeError, ValueError)):
            _step_memory(wrong)
        again = Counting(1.5)
        got = cached(model, "dense", ("train", 4), lambda: (again(), step)[1], read=_step_memory)
        assert again.calls == 1 and got.block_outputs == [{"activations": 0.5}]
        assert json.loads(path.read_text()) == step
