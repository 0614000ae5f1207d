"""Memory snapshots: a restarted process continues bit for bit, a snapshot of another layout is refused, too
little shared memory fails at start-up, and a slot is published only once whole."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from test_checkpoint import ACTOR_KW, model_dir  # noqa: F401 - the same tiny actor (a fixture); puts tests/workers on the path
from dist_helpers import full_params, grouped, rollout_batch, run_ranks  # noqa: E402

from torchrlhf.models import save_tiny_model
from torchrlhf.runtime import registry
from torchrlhf.trainer.checkpointing import SnapshotManager, run_fingerprint
from torchrlhf.utils import snapshot
from torchrlhf.workers.actor import ActorWorker


def _step(actor: ActorWorker, seed: int) -> dict[str, float]:
    batch = rollout_batch(8, seed=seed)
    return actor.update(batch.chunk(actor.dp_size)[actor.dp_rank], temperature=1.0)


def _continued(actor: ActorWorker) -> dict:
    """Steps 2 and 3, the data drawn from the process's RNG so that a lost RNG state shows too (two steps: the
    LR scheduler's state shows only in the second)."""
    noise = torch.randint(0, 1000, ()).item()
    metrics = [_step(actor, seed=2 + noise), _step(actor, seed=3 + noise)]
    return {"metrics": metrics, "params": full_params(actor.model), "noise": noise}


def _on_ranks(rank: int, world: int, model_dir: str, root: str, out: str, mode: str) -> None:
    torch.set_num_threads(1)
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    if mode == "save":
        _step(actor, seed=1)
        torch.rand(7)  # the process's RNG moved on since the seed
        actor.save_snapshot(root, 1, 1)
        want = _continued(actor)
        _step(actor, seed=4)  # a step after the snapshot, which the restarted process must not see
        actor.save_snapshot(root, 0, 3)  # the other slot: slot 1 stays as it was
        actor.finish_snapshot()
    else:
        assert actor.snapshot_holdings(root, 1)["own"] == 1 and actor.snapshot_holdings(root, 0)["own"] == 3
        actor.load_snapshot(root, 1, 1)
        want = _continued(actor)
    if rank == 0:
        torch.save(want, out)


def _assert_continued_alike(straight: Path, restarted: Path) -> None:
    """The restarted processes' steps 2 and 3 equal the uninterrupted ones: metrics, parameters, RNG draws."""
    want, got = torch.load(straight, weights_only=True), torch.load(restarted, weights_only=True)
    assert got["noise"] == want["noise"]
    numbers = [k for k in want["metrics"][0] if not k.startswith(("perf/", "timing"))]  # not the wall-clock ones
    assert "actor/lr" in numbers and len(numbers) >= 5
    for step in (0, 1):
        assert {k: got["metrics"][step][k] for k in numbers} == {k: want["metrics"][step][k] for k in numbers}
    for name, p in want["params"].items():
        assert torch.equal(got["params"][name], p), name


def _on_two_nodes(rank: int, world: int, model_dir: str, root: str, out: str, mode: str) -> None:
    """Each rank on a node of its own (torchrun's GROUP_RANK), keeping the other's snapshot copy."""
    torch.set_num_threads(1)
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    registry.new_group("peers", [0, 1])
    if mode == "save":  # both ranks on one node first: a copy must go to another node
        os.environ["GROUP_RANK"] = "0"
        with pytest.raises(ValueError, match=r"ranks \[0, 1\] are on nodes \['0', '0'\]; a copy on a peer node needs"):
            actor.connect_snapshot_peers("peers")
    os.environ["GROUP_RANK"] = str(rank)
    assert actor.connect_snapshot_peers("peers") == 1 - rank
    if mode == "save":
        own = snapshot.estimate_bytes(actor.model, trainable_only=False)
        need = actor.reserve_snapshot(root)  # its own part and the copy it keeps, claimed at start-up
        kept = snapshot.rank_files(os.path.join(root, f"node{rank}"), 0, "local", 1 - rank, copy_of=True)[0]
        assert os.path.getsize(kept) > 0 and need == own + os.path.getsize(kept)
        _step(actor, seed=1)
        torch.rand(7)
        actor.save_snapshot(root, 1, 1)
        actor.finish_snapshot()
        assert actor.snapshot_holdings(root, 1) == {"own": 1, "copies": {1 - rank: 1}}
        want = _continued(actor)
    else:  # node 1's memory is gone; node 0 keeps rank 1's copy
        assert actor.snapshot_holdings(root, 1) == ({"own": 1, "copies": {1: 1}} if rank == 0 else
                                                    {"own": None, "copies": {}})
        actor.load_snapshot(root, 1, 1, sources={1: 0})
        assert actor.snapshot_holdings(root, 1)["own"] == 1  # rank 1's own part is back in its node's memory
        want = _continued(actor)
    if rank == 0:
        torch.save(want, out)


def test_a_lost_nodes_part_comes_back_from_its_copy_on_another_node(model_dir, tmp_path):
    """Two ranks as two nodes, each sending its snapshot to the other's memory. Node 1 is then replaced (its
    memory deleted): fresh processes load rank 1's part from node 0's copy and continue bit for bit. Ranks all
    on one node are refused: their copies would share the node they guard against."""
    root = str(tmp_path / "shm")
    run_ranks(_on_two_nodes, 2, model_dir, root, str(tmp_path / "straight.pt"), "save")
    shutil.rmtree(os.path.join(root, "node1"))
    run_ranks(_on_two_nodes, 2, model_dir, root, str(tmp_path / "restarted.pt"), "load")
    _assert_continued_alike(tmp_path / "straight.pt", tmp_path / "restarted.pt")


def test_a_restarted_process_continues_bit_for_bit(model_dir, tmp_path):
    """Two ranks (FSDP shards) snapshot after step 1; two fresh processes load it and run step 2 exactly as
    the uninterrupted ones did: the metrics, every parameter, and the data drawn from the restored RNG."""
    root = str(tmp_path / "shm")
    run_ranks(_on_ranks, 2, model_dir, root, str(tmp_path / "straight.pt"), "save")
    run_ranks(_on_ranks, 2, model_dir, root, str(tmp_path / "restarted.pt"), "load")
    _assert_continued_alike(tmp_path / "straight.pt", tmp_path / "restarted.pt")
    # a one-rank worker has another layout: refused with the reason
    with pytest.raises(RuntimeError, match="was written by 2 ranks of local, this run has 1"):
        ActorWorker(model_dir, **grouped(**ACTOR_KW)).load_snapshot(root, 1, 1)


def test_another_model_or_a_half_written_slot_is_refused(model_dir, tmp_path):
    root = str(tmp_path / "shm")
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    _step(actor, seed=1)
    assert actor.save_snapshot(root, 0, 1) == actor.finish_snapshot() > 0
    wider = save_tiny_model(tmp_path / "wider", tokenizer_from=None, vocab_size=160)
    with pytest.raises(RuntimeError, match=r"does not match this run's local: .*embed_tokens.weight is"):
        ActorWorker(str(wider), **grouped(**ACTOR_KW)).load_snapshot(root, 0, 1)
    with pytest.raises(RuntimeError, match="holds step 1, not the published step 2"):
        actor.load_snapshot(root, 0, 2)
    bin_file, meta_file = snapshot.rank_files(snapshot.node_root(root), 0, "local", 0)
    os.truncate(bin_file, os.path.getsize(bin_file) // 2)
    with pytest.raises(RuntimeError, match="is truncated"):
        ActorWorker(model_dir, **grouped(**ACTOR_KW)).load_snapshot(root, 0, 1)
    Path(meta_file).write_bytes(Path(meta_file).read_bytes()[:100])  # killed while writing the description
    assert actor.snapshot_holdings(root, 0) == {"own": None, "copies": {}}


def test_an_update_waits_for_the_snapshot_being_written(model_dir, tmp_path, monkeypatch):
    """The write runs in the background; the next optimizer step must not start before it is whole, or the
    snapshot would hold half-updated tensors. The writer is held back here; an optimizer pre-step hook records
    whether the slot already names its step when the step begins."""
    root = str(tmp_path / "shm")
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    _step(actor, seed=1)
    before = {k: v.clone() for k, v in full_params(actor.model).items()}
    stepped, held = threading.Event(), []
    slow_bytes = snapshot._bytes

    def held_back(t):
        if not held:  # the first tensor only: a missing wait in `update` lets the step happen meanwhile
            held.append(stepped.wait(timeout=2.0))
        return slow_bytes(t)

    monkeypatch.setattr(snapshot, "_bytes", held_back)
    seen = []

    def before_step(*_) -> None:
        seen.append(actor.snapshot_holdings(root, 0)["own"])
        stepped.set()

    actor.optimizer.register_step_pre_hook(before_step)
    actor.save_snapshot(root, 0, 1)
    _step(actor, seed=2)
    assert seen and seen[0] == 1 and held == [False]  # the step began after the write, not during it
    monkeypatch.undo()
    restored = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    restored.load_snapshot(root, 0, 1)
    for name, p in full_params(restored.model).items():
        assert torch.equal(p, before[name]), name


def test_too_little_shared_memory_fails_at_reserve_and_gives_back_what_it_took(model_dir, tmp_path):
    """The filesystem refuses the space (here a file-size limit below it stands in for a full tmpfs)."""
    actor = ActorWorker(model_dir, **grouped(**ACTOR_KW))
    root = str(tmp_path / "shm")
    need = actor.reserve_snapshot(root)
    assert need >= 3 * sum(p.numel() * 4 for p in actor.model.parameters())  # weights + Adam's two moments
    assert os.path.getsize(snapshot.rank_files(snapshot.node_root(root), 1, "local", 0)[0]) == need
    old_limit, old_handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (need // 2, old_limit[1]))
    try:
        with pytest.raises(RuntimeError, match=r"(?s)needs 2 x .* GiB under .*docker --shm-size.*snapshot_freq=0"):
            actor.reserve_snapshot(str(tmp_path / "small"))
        assert not any(f.is_file() for f in (tmp_path / "small").rglob("*"))
        # a snapshot bigger than its reservation (an optimizer with more state than Adam's) fails the same way
        _step(actor, seed=1)
        with pytest.raises(RuntimeError, match=r"(?s)memory snapshot of local rank 0 needs 2 x .*docker --shm-size"):
            actor.save_snapshot(str(tmp_path / "unreserved"), 0, 1)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert actor.snapshot_holdings(str(tmp_path / "unreserved"), 0)["own"] is None  # nothing half-published


def test_a_slot_is_published_atomically_and_another_run_is_refused(tmp_path):
    root = str(tmp_path / "shm")
    fingerprint = run_fingerprint({"trainer": {"total_steps": 4}}, world_size=2)
    snaps = SnapshotManager(root, fingerprint)
    assert snaps.latest() is None and snaps.next_slot() == 0
    snaps.publish(1, 0, {"global_step": 1})
    assert snaps.latest() == {"step": 1, "slot": 0, "fingerprint": fingerprint} and snaps.next_slot() == 1
    snaps.publish(2, 1, {"global_step": 2})
    assert snaps.latest()["step"] == 2 and snaps.next_slot() == 0
    assert snaps.load_controller_state(1) == {"global_step": 2} and snaps.refusal(snaps.latest()) is None
    for other in (run_fingerprint({"trainer": {"total_steps": 4}}, world_size=4),
                  run_fingerprint({"trainer": {"total_steps": 5}}, world_size=2)):
        assert "written by another config or world size" in SnapshotManager(root, other).refusal(snaps.latest())
    Path(root, "LATEST").write_text('{"step": 3')  # a torn file is no snapshot
    assert snaps.latest() is None
    Path(root, "LATEST").write_text(json.dumps({"step": 2, "slot": 1, "fingerprint": fingerprint}))
    snaps.clear()
    assert not os.path.exists(root)
