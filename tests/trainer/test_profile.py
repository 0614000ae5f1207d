"""``trainer.profile``: a 2-rank run writes each role's torch.profiler trace and table for the listed step."""

from __future__ import annotations

import json

from conftest import assert_ok, run_recipe, write_config

MATMULS = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}  # the engine's CPU linears are mkldnn's


def test_profile_writes_a_trace_per_role_and_rank(tiny_model_dir, tmp_path):
    """Two steps, the second profiled; a KL loss brings the reference: actor, ref and rollout on both ranks."""
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.yaml", tiny_model_dir,
                          actor={"loss": {"use_kl_loss": True}, "batching": {"ppo_micro_batch_size_per_device": 8}},
                          trainer={"total_steps": 2, "output_dir": str(out), "profile": {"steps": [2]}})
    assert_ok(run_recipe(config, nproc=2))
    assert not (out / "profile" / "step_1").exists()  # only the listed step
    calls = {"actor": "actor.update", "ref": "ref.compute_ref_log_prob", "rollout": "rollout.generate"}
    for role, call in calls.items():
        for rank in (0, 1):
            stem = out / "profile" / "step_2" / f"{role}_rank{rank}"
            events = json.loads(stem.with_suffix(".json").read_text())["traceEvents"]
            names = {e.get("name") for e in events}
            assert call in names, (role, rank, sorted(n for n in names if n and "." in n))  # the call's span
            assert names & MATMULS, (role, rank)  # the compute, recorded in the thread that ran it
            table = stem.with_suffix(".txt").read_text()
            assert f"role {role}, rank {rank}, step 2" in table and "Self CPU" in table
            assert "aten::" in table
