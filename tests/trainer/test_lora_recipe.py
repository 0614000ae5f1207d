"""``actor.lora`` in the recipe: config errors before anything loads, one model per rank (the actor serves the
reference), the dry run's memory estimate, and a split-placement run that syncs adapters only and resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_ok, metrics_of, run_recipe, write_config

from torchrlhf.config import ConfigError, load_config
from torchrlhf.models.lora import LoRAConfig
from torchrlhf.trainer.build import role_specs
from torchrlhf.trainer.explain import explain, model_shape
from torchrlhf.trainer.schema import load_recipe_config, role_ranks

LORA = {"rank": 4, "alpha": 8}


def _load(tmp_path: Path, model_dir: str, world: int = 1, **sections):
    return load_recipe_config(load_config(write_config(tmp_path / "c.yaml", model_dir, **sections)), world)


@pytest.mark.parametrize("sections, message", [
    ({"actor": {"lora": {"rank": 0}}}, "actor.lora.rank: must be a positive integer, got 0"),
    ({"actor": {"lora": {"rank": -4}}}, "actor.lora.rank: must be a positive integer, got -4"),
    ({"actor": {"lora": {"rnk": 4}}}, "actor.lora.rnk: unknown key (did you mean 'rank'?)"),
    ({"actor": {"lora": {"dropout": 1.0}}}, "actor.lora.dropout: must be in [0, 1), got 1.0"),
    ({"actor": {"lora": {"target_modules": ["q_proj", "qkv_proj"]}}},
     "actor.lora.target_modules: ['qkv_proj'] match no module of LlamaForCausalLM; its Linear layers are named "
     "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']"),
    ({"actor": {"lora": {"target_modules": ["embed_tokens"]}}}, "LoRA wraps nn.Linear layers only"),
    ({"actor": {"lora": {"target_modules": "model\\.layers\\.9\\..*"}}}, "matches no module of LlamaForCausalLM"),
    ({"algorithm": {"adv_estimator": "gae"}, "critic": {"model_path": "${model_path}", "lora": LORA}},
     "critic.lora: LoRA is supported for the actor only"),
    ({"actor": {"lora": LORA, "loss": {"use_kl_loss": True}}, "ref": {"dtype": "bfloat16", "cpu_offload": True}},
     "ref.dtype, ref.cpu_offload: with actor.lora the reference is the actor's base model"),
])
def test_bad_lora_config_is_refused_before_anything_loads(tiny_model_dir, tmp_path, sections, message):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, tiny_model_dir, **sections)
    assert message in str(e.value), str(e.value)


def test_a_lora_actor_is_its_own_reference(tiny_model_dir, tmp_path):
    cfg = _load(tmp_path, tiny_model_dir, actor={"lora": LORA, "loss": {"use_kl_loss": True}})
    assert cfg.actor.lora == LoRAConfig(rank=4, alpha=8.0)
    assert "ref" not in role_ranks(cfg, 1) and "ref" not in role_specs(cfg, 1)  # one model per rank
    full = _load(tmp_path, tiny_model_dir, actor={"loss": {"use_kl_loss": True}})
    assert "ref" in role_specs(full, 1)  # a full fine-tuning actor still gets its frozen copy


def test_dry_run_memory_knows_lora(tiny_model_dir, tmp_path):
    cfg = _load(tmp_path, tiny_model_dir, world=2, actor={"lora": LORA, "loss": {"use_kl_loss": True}},
                placement={"actor": [0], "rollout": [1]})
    text = explain(cfg, 2)
    shape = model_shape(tiny_model_dir, cfg.actor.lora)
    plain = model_shape(tiny_model_dir)
    assert shape.params == plain.params and 0 < shape.adapter_params < plain.params / 5
    assert shape.tensors == plain.tensors  # the adapters merge into the weights a sync moves
    adapters_gib = shape.adapter_params * 4 / 2**30
    # one fp32 rank, unsharded: the base and adapters as loaded; AdamW's states for the adapters only
    assert f"actor parameters {(shape.params + shape.adapter_params) * 4 / 2**30:.2f} GiB" in text
    assert f"actor optimizer states {2 * adapters_gib:.2f} GiB" in text
    assert "ref       served by the actor" in text and "ref parameters" not in text
    assert f"each sync carries the adapters only ({shape.adapter_params * 4 / 2**20:.2f} MiB" in text


def test_split_placement_syncs_adapters_and_resumes(tiny_model_dir, tmp_path):
    """Actor on rank 0, rollout on rank 1, KL loss against the actor's own base. Two mini-batches
    make the actor recompute old log-probs, so a rollout engine still on the base weights (or on a stale
    merge) shows as a gap between its sampling probabilities and the actor's. Only adapter bytes travel.
    A run resumed from step 2 syncs the loaded adapters and then equals the uninterrupted run."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    sections = {"actor": {"optim": {"lr": 3e-2}, "lora": LORA, "loss": {"use_kl_loss": True},
                          "batching": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 4}},
                "placement": {"actor": [0], "rollout": [1]}}

    def config(out: Path, steps: int, save_freq: int) -> Path:
        trainer = {"total_steps": steps, "checkpoint": {"save_freq": save_freq}, "test_freq": 0, "output_dir": str(out),
                   "loggers": ["jsonl"]}
        return write_config(tmp_path / f"{out.name}{steps}.yaml", tiny_model_dir, trainer=trainer, **sections)

    assert_ok(run_recipe(config(straight, 3, 0), nproc=2))
    want = metrics_of(straight)
    shape = model_shape(tiny_model_dir, LoRAConfig(**LORA))
    assert all(m["training/rollout_probs_diff_max"] < 1e-3 for m in want), want
    assert [m["weight_sync/bytes"] for m in want[:2]] == [shape.adapter_params * 4] * 2, want
    assert all(m["actor/kl_loss"] > 0 for m in want[1:]), want  # the trained policy left its base
    assert_ok(run_recipe(config(resumed, 2, 2), nproc=2))
    assert_ok(run_recipe(config(resumed, 3, 0), nproc=2))
    got = metrics_of(resumed)
    assert [m["training/global_step"] for m in got] == [1, 2, 3]
    assert got[2]["training/rollout_probs_diff_max"] < 1e-3, got[2]
    for key in ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "response_length/mean"]:
        assert got[2][key] == pytest.approx(want[2][key], rel=1e-4, abs=1e-6), key
