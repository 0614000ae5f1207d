"""Agent rollouts through the recipe, on every placement and schedule (tiny model, a three-turn environment).

One rollout path serves them all: the same sessions, the engine's own multi-turn loop, the same columns.
With two PPO epochs the old log-probs are recomputed by the training forward, which sees each whole
trajectory (observations included) as context: its probabilities must equal the engine's on every model
token, whether the prompts are shared (shared_prefix) or not.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from conftest import assert_ok, metrics_of, run_recipe, write_config

AGENT = {"agent": {"env": {"_component_": "custom_components.CountingEnv"}, "reward": "sum", "max_turns": 4},
         "max_tokens": 24, "stop_token_ids": list(range(0, 49152, 9)),  # frequent stops: short turns
         "engine": {"max_batch_size": 16, "max_seq_len": 200}}
EXACT = ("actor.batching.ppo_epochs=2",)  # recompute old log-probs with the training forward


def _run(tmp_path, tiny_model_dir, name, nproc, *overrides, rollout=None, **sections):
    out = tmp_path / name
    trainer = {"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"], "test_freq": 2}
    cfg = write_config(tmp_path / f"{name}.yaml", tiny_model_dir, trainer={**trainer, **sections.pop("trainer", {})},
                       rollout={**AGENT, **(rollout or {})}, **sections)
    assert_ok(run_recipe(cfg, *overrides, nproc=nproc))
    return metrics_of(out)


def _check(metrics: list[dict], k: int = 0, out=None) -> None:
    assert len(metrics) == 2
    for m in metrics:
        assert m["num_turns/mean"] >= 2 and m["num_turns/max"] <= 4  # several turns, within max_turns
        assert m["agent/observation_tokens/mean"] > 0 and m["agent/env_reward/mean"] > 0
        assert m["agent/env_errors/mean"] == 0 and m["agent/agent_error/mean"] == 0
        assert m["rollout/staleness/max"] <= k
        if "training/rollout_probs_diff_max" in m:
            assert m["training/rollout_probs_diff_max"] < 2e-3, m["training/rollout_probs_diff_max"]
    assert "val/arithmetic/acc" in metrics[-1]  # validation runs the agent too
    if out is not None:  # validation samples show the environment's observations, not only the model's turns
        samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert any("<|im_start|>user\nturn 1 done<|im_end|>" in s["trajectory"] for s in samples)
        assert not any("turn 1 done" in s["response"] for s in samples)  # the model's turns only


@pytest.mark.parametrize("shared_prefix,nproc", [(True, 2), (False, 1)])
def test_agent_sync_colocated(tiny_model_dir, tmp_path, shared_prefix, nproc):
    """On 2 ranks each rank's trajectories come back as wide as its longest: the generate collect pads them."""
    metrics = _run(tmp_path, tiny_model_dir, f"colocated_{shared_prefix}", nproc, *EXACT,
                   f"actor.shared_prefix={str(shared_prefix).lower()}", "actor.batching.ppo_micro_batch_size_per_device=8")
    _check(metrics, out=tmp_path / f"colocated_{shared_prefix}")
    assert all("training/rollout_probs_diff_max" in m for m in metrics)


def test_agent_sync_split(tiny_model_dir, tmp_path):
    metrics = _run(tmp_path, tiny_model_dir, "split", 3, *EXACT, placement={"actor": [0], "rollout": [1, 2]})
    _check(metrics)


def test_agent_async_stream_with_partial_rollouts(tiny_model_dir, tmp_path):
    metrics = _run(tmp_path, tiny_model_dir, "async", 3, placement={"actor": [0], "rollout": [1, 2]},
                   trainer={"mode": "async"}, async_training={"max_staleness": 1, "partial_rollout": True},
                   actor={"loss": {"rollout_is": "token"}})
    _check(metrics, k=1)


def test_agent_sync_vllm(tiny_model_dir, tmp_path):
    from torchrlhf.generation import vllm_available

    available, why = vllm_available()
    if not available:
        pytest.skip(f"vLLM is not importable here ({why})")
    # vLLM's CPU attention needs head_dim >= 32: a wider tiny model
    from torchrlhf.models import save_tiny_model

    wide = str(save_tiny_model(tmp_path / "wide", tokenizer_from="smollm2", initializer_range=1.0,
                               hidden_size=128, intermediate_size=192, head_dim=32))
    engine = {**AGENT["engine"], "_component_": "torchrlhf.generation.VLLMEngine"}
    metrics = _run(tmp_path, wide, "vllm", 1, *EXACT, rollout={"engine": engine})
    _check(metrics)


# A user's project folder: a TRL-shaped environment class (TRL's `environment_factory` shape) in its own module,
# imported by name from the folder the run starts in, and a data file with the user's own columns.
USER_ENV = textwrap.dedent(
    '''
    class Counter:
        def reset(self, **row):
            if not isinstance(row["ground_truth"], list):  # the row as written, not as text
                raise TypeError(f"ground_truth arrived as {type(row['ground_truth']).__name__}")
            self.weight = row["extra_info"]["weight"]  # the user's own column
            self.total = 0

        def increment(self, a: int) -> int:
            """Add to the running total.

            Args:
                a: how much to add.
            """
            self.total += a
            return self.total

        def get_reward(self) -> float:
            return self.weight
    '''
)


def test_trl_environment_class_from_the_project_folder(tiny_model_dir, tmp_path):
    """reset(**row) gets every column as written (a missing or mistyped one would count env_errors), get_reward is
    the score (reward: env), a per-row max_tokens bounds the trajectory, and `myenv.Counter` imports from the folder
    the run starts in (no PYTHONPATH)."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "myenv.py").write_text(USER_ENV)
    rows = [{"prompt": f"Add {i} with the increment tool.", "ground_truth": [i, 1], "data_source": "counter",
             "extra_info": {"weight": 0.75}, "max_tokens": 5} for i in range(8)]
    data = project / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "trl_env"
    cfg = write_config(tmp_path / "trl_env.yaml", tiny_model_dir,
                       data={"train_files": [str(data)], "val_files": [str(data)], "val_max_samples": 4},
                       rollout={"max_tokens": 24, "agent": {"env": {"_component_": "myenv.Counter"}, "reward": "env"},
                                "engine": {"max_batch_size": 16, "max_seq_len": 200}},
                       trainer={"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"], "test_freq": 2})
    assert_ok(run_recipe(cfg, cwd=project))
    metrics = metrics_of(out)
    assert len(metrics) == 2
    for m in metrics:
        assert m["agent/env_errors/mean"] == 0 and m["agent/agent_error/mean"] == 0
        assert m["agent/env_reward/mean"] == 0.75 and m["critic/score/mean"] == 0.75
        assert m["response_length/max"] <= 5  # the row's max_tokens, under rollout.max_tokens=24
    assert metrics[-1]["val/counter/acc"] == 0.75
