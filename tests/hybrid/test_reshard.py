"""The hybrid engine: train→generation resharding, its memory bound, and the generation-mode lifecycle.

The multi-rank checks live in `reshard_checks.py`; one torchrun (4 ranks, gloo) runs them all and
each rank writes its results, which the tests below read by group. Every check compares against an
independent reference (slices of the unsharded state dict, DTensor's `full_tensor()`, or an HF
forward pass on the gathered weights), never against the resharder's own output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchrlhf.hybrid import generation_mode
from torchrlhf.hybrid.reshard import ReshardStats, _chunk_bounds, permute_blocks

ROOT = Path(__file__).resolve().parents[2]
NPROC = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    prefix = tmp_path_factory.mktemp("hybrid") / "res"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={NPROC}",
           str(ROOT / "tests/hybrid/reshard_checks.py"), str(prefix)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    merged: dict[str, dict] = {}
    for rank in range(NPROC):
        path = Path(f"{prefix}.{rank}.json")
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no results (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        for name, res in json.loads(path.read_text()).items():
            m = merged.setdefault(name, {"ok": True, "detail": ""})
            if not res["ok"] and m["ok"]:
                m.update(ok=False, detail=f"rank {rank}: {res['detail']}")
    return merged


def assert_group(results: dict[str, dict], *prefixes: str) -> None:
    names = [k for k in results if k.startswith(prefixes)]
    assert names, f"no checks named {prefixes} ran"
    failed = {k: results[k]["detail"] for k in names if not results[k]["ok"]}
    assert not failed, failed


def test_check_functions_completed(results):
    assert_group(results, "llama_checks", "uneven_checks", "update_checks", "mode_checks",
                 "training_tp_checks", "engine_checks")


def test_hybridflow_layout(results):
    # rank r: tp index r // d, micro-DP index r % d (contiguous micro-DP groups, strided TP groups)
    assert_group(results, "layout/")


def test_fsdp_to_tp1_exact_with_tied_embeddings_and_gqa(results):
    assert_group(results, "llama_tp1_")


def test_fsdp_to_tp2_exact_with_tied_embeddings_and_gqa(results):
    assert_group(results, "llama_tp2_")


def test_uneven_shapes_exact_and_bounded(results):
    assert_group(results, "uneven_tp1/", "uneven_tp2/", "uneven_tp4/")


def test_bytes_received_equal_the_lower_bound(results):
    assert_group(results, "llama_tp1_engine/bytes", "llama_tp2_engine/bytes", "llama_tp2_vocab/bytes")


def test_peak_transient_memory_at_most_one_parameter(results):
    names = [k for k in results if "peak_le" in k]
    assert len(names) >= 8
    assert_group(results, *names)


def test_next_transition_delivers_updated_weights(results):
    assert_group(results, "update/", "update_tp1/", "update_tp2/")


def test_generation_mode_lifecycle(results):
    assert_group(results, "mode/")


def test_training_tp_shards_reused(results):
    assert_group(results, "train_dp")


def test_engine_generates_with_the_current_weights(results):
    assert_group(results, "engine_tp1/", "engine_tp2/")


def test_actor_hook_returns_each_ranks_own_rows(results):
    assert_group(results, "hook_tp1/", "hook_tp2/")


def test_cast_during_transfer_is_exact(results):
    assert_group(results, "llama_tp1_bf16/", "llama_tp2_bf16/")


# ---- single process ----------------------------------------------------------------------------


@pytest.mark.parametrize("size,n", [(10, 4), (3, 4), (8, 4), (6, 4), (7, 2), (0, 3)])
def test_chunk_bounds_follow_torch_chunk(size, n):
    chunks = torch.arange(size).chunk(n) if size else ()
    for i in range(n):
        start, length = _chunk_bounds(size, n, i)
        want = chunks[i].tolist() if i < len(chunks) else []
        assert list(range(start, start + length)) == want


def test_permute_blocks_in_place_with_one_block_of_scratch():
    blocks = torch.arange(12.0).view(6, 2).clone()
    dest = [3, 0, 4, 1, 5, 2]  # dp-major (i, k) blocks of a 2x... grid -> chunk order
    want = torch.empty_like(blocks)
    want[dest] = blocks
    stats = ReshardStats()
    permute_blocks(blocks, dest, stats)
    assert torch.equal(blocks, want)
    assert stats.peak_transient_bytes == blocks[0].nbytes


class _Engine:
    tp_size, tp_mesh = 1, None

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.weights: dict[str, torch.Tensor] = {}

    def resume(self, tags=("weights", "kv_cache")):
        self.calls.extend(f"resume:{t}" for t in tags)

    def release(self):
        self.calls.append("release")

    def update_weights(self, named_tensors):
        self.calls.append("update_weights")
        self.weights = {k: v.clone() for k, v in named_tensors}

    def param_shard_dims(self):
        return {}


def test_generation_mode_single_process_hands_over_plain_weights_and_releases_on_error():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model(torch.randn(4, 3)).sum().backward()
    engine = _Engine()
    with pytest.raises(RuntimeError, match="inside"):
        with generation_mode(model, engine):
            assert all(p.grad is None for p in model.parameters())
            raise RuntimeError("inside")
    # verl's order: weights come back and are refilled before the KV cache is allocated
    assert engine.calls == ["resume:weights", "update_weights", "resume:kv_cache", "release"]
    assert engine.weights.keys() == dict(model.named_parameters()).keys()
    assert all(torch.equal(engine.weights[k], p) for k, p in model.named_parameters())


def test_optimizer_offload_frees_state_storage_and_restores_it_exactly():
    from torchrlhf.hybrid.mode import OptimizerOffload

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = {(i, k): v.clone() for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    off = OptimizerOffload(opt)
    moments = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    assert moments and all(v.untyped_storage().nbytes() == 0 for v in moments)
    off.restore()
    after = {(i, k): v for i, st in enumerate(opt.state.values()) for k, v in st.items()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
