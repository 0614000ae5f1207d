"""`WeightRelay`: versions kept, loaded exactly, waited for, forgotten; it owns its tensors."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torchrlhf.hybrid.relay import WeightRelay


class RecordingEngine:
    """Stands in for an engine: remembers the tensors it was last given."""

    tp_size, tp_mesh = 1, None

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def param_shard_dims(self) -> dict[str, int | None]:
        return {"w": None, "b": None}

    def update_weights(self, named_tensors) -> None:
        self.weights.update({name: t.clone() for name, t in named_tensors})


def _send(relay: WeightRelay, version: int) -> None:
    w, b = torch.full((2, 3), float(version)), torch.full((3,), -float(version))
    inbox = relay.inbox()
    inbox.update_weights([("w", w), ("b", b)])
    w.fill_(99.0)  # the sender reuses its buckets: the relay must hold its own copy
    relay.publish(version, inbox)


def test_load_exact_and_newest_and_forget_older():
    engine = RecordingEngine()
    relay = WeightRelay(engine, capacity=3)
    for v in (1, 2, 3):
        _send(relay, v)
    assert relay.versions() == [1, 2, 3] and relay.newest() == 3
    assert relay.load(engine, 2) == 2
    assert torch.equal(engine.weights["w"], torch.full((2, 3), 2.0))
    assert torch.equal(engine.weights["b"], torch.full((3,), -2.0))
    assert relay.versions() == [2, 3]  # loading 2 forgot 1
    assert relay.load(engine) == 3 and relay.versions() == [3]
    assert torch.equal(engine.weights["w"], torch.full((2, 3), 3.0))


def test_a_repack_target_keeps_older_versions_to_go_back_to():
    """A long-tail replica continues samples of several versions: loading 3 keeps 1 and 2, and it loads 1 next."""
    engine = RecordingEngine()
    relay = WeightRelay(engine, capacity=3)
    for v in (1, 2, 3):
        _send(relay, v)
    assert relay.load(engine, 3, forget_older=False) == 3 and relay.versions() == [1, 2, 3]
    assert relay.load(engine, 1, forget_older=False) == 1
    assert torch.equal(engine.weights["w"], torch.full((2, 3), 1.0))


def test_capacity_forgets_the_oldest_and_a_forgotten_version_is_an_error():
    relay = WeightRelay(RecordingEngine(), capacity=2)
    for v in (1, 2, 3):
        _send(relay, v)
    assert relay.versions() == [2, 3]
    with pytest.raises(LookupError, match="version 1 left the relay"):
        relay.load(RecordingEngine(), 1)


def test_load_waits_for_a_version_on_its_way_and_times_out_otherwise():
    engine = RecordingEngine()
    relay = WeightRelay(engine, capacity=2)
    _send(relay, 1)
    sender = threading.Thread(target=lambda: (time.sleep(0.2), _send(relay, 2)))
    sender.start()
    assert relay.load(engine, 2, timeout=10) == 2  # blocks until the background receive publishes it
    sender.join()
    assert torch.equal(engine.weights["w"], torch.full((2, 3), 2.0))
    with pytest.raises(TimeoutError, match="version 5 did not reach the relay"):
        relay.load(engine, 5, timeout=0.1)


def test_a_sync_abandoned_half_way_does_not_mix_into_the_next():
    """A sender that died mid-sync leaves a partial inbox behind; the retried sync publishes only its own."""
    engine = RecordingEngine()
    relay = WeightRelay(engine, capacity=2)
    abandoned = relay.inbox()
    abandoned.update_weights([("w", torch.full((2, 3), -7.0))])  # "b" never arrives
    retried = relay.inbox()
    retried.update_weights([("w", torch.full((2, 3), 4.0)), ("b", torch.full((3,), -4.0))])
    relay.publish(4, retried)
    assert relay.load(engine, 4) == 4
    assert torch.equal(engine.weights["w"], torch.full((2, 3), 4.0))
    assert torch.equal(engine.weights["b"], torch.full((3,), -4.0))
