"""Tensor-parallel generation on 2 gloo ranks equals TP=1: dense families (heads and MLP columns split) and
Qwen3-MoE (heads split, each rank running half of the experts, `models.expert_parallel.split_experts_over_tp`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams

from gen_helpers import left_padded, tiny_model

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from dist_helpers import run_ranks  # noqa: E402

FAMILIES = ("qwen2", "llama", "qwen3_moe")
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=10, seed=4)


def prompts() -> Batch:
    ids, mask = left_padded([5, 8, 3, 6], seed=2)
    return Batch({"input_ids": ids, "attention_mask": mask})


def _worker(rank: int, world: int, out_dir: str) -> None:
    mesh = dist.device_mesh.init_device_mesh("cpu", (world,))
    results = {}
    for family in FAMILIES:
        moe = family == "qwen3_moe"
        engine = NativeEngine(tiny_model(family, seed=0), max_batch_size=3, max_seq_len=64, tp_mesh=mesh,
                              record_routes=moe)
        greedy = engine.generate(prompts(), GREEDY)
        results[family, "greedy"] = greedy["responses"]
        if moe:
            results[family, "routes"] = greedy["routed_experts"]
            results[family, "local_experts"] = engine.model.model.layers[0].mlp.experts.gate_up_proj.shape[0]
        sampled = engine.generate(prompts(), SAMPLED)
        results[family, "sampled"] = sampled["responses"]
        results[family, "sampled_lp"] = sampled["rollout_log_probs"]
        # Free everything, then stream another model's weights in as this rank's local shards.
        dims = engine.param_shard_dims()
        engine.release()
        engine.resume()
        new = tiny_model(family, seed=1)
        engine.update_weights(
            (name, p.detach() if dims[name] is None else p.detach().chunk(world, dims[name])[rank])
            for name, p in new.named_parameters()
        )
        results[family, "updated"] = engine.generate(prompts(), GREEDY)["responses"]
        results[family, "dims"] = dims
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def test_tp2_matches_tp1(tmp_path):
    run_ranks(_worker, 2, str(tmp_path), timeout=120)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    for family in FAMILIES:
        for key in ("greedy", "sampled", "updated"):
            assert torch.equal(r0[family, key], r1[family, key]), (family, key)  # ranks agree
        moe = family == "qwen3_moe"
        single = NativeEngine(tiny_model(family, seed=0), max_batch_size=3, max_seq_len=64, record_routes=moe)
        greedy = single.generate(prompts(), GREEDY)
        assert torch.equal(r0[family, "greedy"], greedy["responses"]), family
        if moe:  # each rank holds 4 of the 8 experts, and the recorded routes are the one-rank engine's
            assert r0[family, "local_experts"] == r1[family, "local_experts"] == 4
            assert torch.equal(r0[family, "routes"], greedy["routed_experts"])
            assert torch.equal(r1[family, "routes"], greedy["routed_experts"])
        ref = single.generate(prompts(), SAMPLED)
        assert torch.equal(r0[family, "sampled"], ref["responses"]), family
        torch.testing.assert_close(r0[family, "sampled_lp"], ref["rollout_log_probs"], atol=1e-4, rtol=1e-4)
        updated = NativeEngine(tiny_model(family, seed=1), max_batch_size=3, max_seq_len=64)
        assert torch.equal(r0[family, "updated"], updated.generate(prompts(), GREEDY)["responses"]), family
        dims = r0[family, "dims"]
        assert dims["model.layers.0.self_attn.q_proj.weight"] == 0
        assert dims["model.layers.1.self_attn.o_proj.weight"] == 1
        assert dims["model.embed_tokens.weight"] is None
        if family == "qwen3_moe":
            assert dims["model.layers.0.mlp.experts.gate_up_proj"] == dims["model.layers.1.mlp.experts.down_proj"] == 0
            assert dims["model.layers.0.mlp.gate.weight"] is None  # the router: every rank routes every token
        else:
            assert dims["model.layers.0.mlp.down_proj.weight"] == 1
        if family == "qwen2":
            assert dims["model.layers.0.self_attn.k_proj.bias"] == 0
