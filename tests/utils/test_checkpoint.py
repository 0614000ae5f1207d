"""DCP checkpoints: resharding across world sizes, identical continuation, RNG, completeness marker."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from dist_helpers import full_params, rollout_batch, run_ranks, grouped  # noqa: E402

from torchrlhf.models import save_tiny_model  # noqa: E402
from torchrlhf.utils.checkpoint import COMPLETE, is_complete, load_checkpoint, rng_state, set_rng_state  # noqa: E402
from torchrlhf.workers.actor import ActorWorker  # noqa: E402

ACTOR_KW = dict(lr=1e-3, warmup_steps=3, ppo_mini_batch_size=2, rollout_n=2, ppo_micro_batch_size_per_device=1,
                ppo_epochs=2, entropy_coeff=0.01)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.set_num_threads(1)
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny"), tokenizer_from=None, vocab_size=128))


def _shard(actor: ActorWorker, batch):
    return batch.chunk(actor.dp_size)[actor.dp_rank]


def _first_step_then_save(actor: ActorWorker, ckpt: str) -> None:
    actor.update(_shard(actor, rollout_batch(8, seed=1)), temperature=1.0)
    actor.save_checkpoint(ckpt)


def _next_step(actor: ActorWorker) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    metrics = actor.update(_shard(actor, rollout_batch(8, seed=2)), temperature=1.0)
    return metrics, full_params(actor.model)


def _on_ranks(rank: int, world: int, model_dir: str, ckpt: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    if mode == "save":
        _first_step_then_save(actor, ckpt)
    else:
        actor.load_checkpoint(ckpt)
    metrics, params = _next_step(actor)
    if rank == 0:
        torch.save({"metrics": metrics, "params": params}, out)


def _assert_same(got_metrics, got_params, want):
    assert got_metrics["actor/lr"] == pytest.approx(want["metrics"]["actor/lr"])  # scheduler restored (warmup)
    for key in ("actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm"):
        assert got_metrics[key] == pytest.approx(want["metrics"][key], rel=1e-4, abs=1e-6), key
    for name, p in want["params"].items():
        torch.testing.assert_close(got_params[name], p, atol=2e-5, rtol=1e-4, msg=name)


def test_save_on_two_ranks_load_on_one(model_dir, tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out.pt")
    run_ranks(_on_ranks, 2, model_dir, ckpt, out, "save")
    assert is_complete(ckpt) and not os.path.exists(ckpt + ".tmp")
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    actor.load_checkpoint(ckpt)
    metrics, params = _next_step(actor)
    _assert_same(metrics, params, torch.load(out, weights_only=True))


def test_save_on_one_load_on_two(model_dir, tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out.pt")
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    _first_step_then_save(actor, ckpt)
    metrics, params = _next_step(actor)
    run_ranks(_on_ranks, 2, model_dir, ckpt, out, "load")
    got = torch.load(out, weights_only=True)
    _assert_same(got["metrics"], got["params"], {"metrics": metrics, "params": params})


def test_incomplete_checkpoint_is_refused_and_resave_replaces(model_dir, tmp_path):
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    ckpt = tmp_path / "ckpt"
    actor.save_checkpoint(str(ckpt))
    (ckpt / COMPLETE).unlink()  # as if the writer died before finishing
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(ckpt, model=actor.model)
    os.makedirs(f"{ckpt}.tmp/junk")  # leftovers of an interrupted save are cleared
    actor.save_checkpoint(str(ckpt))
    assert is_complete(ckpt) and not os.path.exists(f"{ckpt}.tmp") and not os.path.exists(f"{ckpt}.old")


def test_rng_state_round_trip_through_weights_only_file(tmp_path):
    torch.manual_seed(3), random.seed(3), np.random.seed(3)
    torch.randn(2), random.gauss(0, 1), np.random.randn()  # leaves a cached gaussian in python and numpy
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (torch.randn(4), [random.random() for _ in range(3)], random.gauss(0, 1), np.random.randn(3))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.randn(4), [random.random() for _ in range(3)], random.gauss(0, 1), np.random.randn(3))
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and got[2] == want[2]
    assert np.array_equal(got[3], want[3])


def test_a_corrupted_checkpoint_file_is_named(model_dir, tmp_path):
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    ckpt = tmp_path / "ckpt"
    actor.save_checkpoint(str(ckpt))
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])  # truncated, as by a failing disk
    with pytest.raises(RuntimeError, match=rf"(?s)checkpoint {ckpt} could not be read .*corrupted or truncated"):
        load_checkpoint(ckpt, model=actor.model)
