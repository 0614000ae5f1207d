"""Ecosystem environment sources through the recipe (2 steps, token-exact): an OpenEnv server and a verifiers module.

SmolLM2 samples greedily: ``check_tokens: error`` re-tokenizes the decoded turns, and a sampled token sequence that
is not the tokenizer's own encoding of its text would count as drift although the trajectory is exact.

Each needs its optional package (``pip install 'torchrlhf[openenv]'`` / ``'torchrlhf[verifiers]'``) and skips
without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from conftest import assert_ok, metrics_of, run_recipe, write_config

AGENTS_TESTS = Path(__file__).resolve().parents[1] / "agents"


def _check(metrics: list[dict], max_turns: int) -> None:
    assert len(metrics) == 2
    for m in metrics:
        assert 1 <= m["num_turns/mean"] and m["num_turns/max"] <= max_turns
        assert m["agent/env_errors/mean"] == 0 and m["agent/agent_error/mean"] == 0
        assert m["agent/token_mismatches/mean"] == 0  # check_tokens: error also stops the run on one


SMALL = {"data": {"max_prompt_length": 96, "train_batch_size": 2, "val_max_samples": 2},
         "actor": {"batching": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 4}}}


def test_openenv_echo_server(tmp_path, monkeypatch):
    pytest.importorskip("openenv.core.env_server")
    monkeypatch.syspath_prepend(str(AGENTS_TESTS))
    from openenv_server import echo_server

    with echo_server() as (url, _):
        env = {"_component_": "torchrlhf.agents.OpenEnv", "base_url": url, "observation_key": "echoed_message",
               "timeout_s": 60}
        rollout = {"agent": {"env": env, "reward": "env", "max_turns": 3, "check_tokens": "error"}, "n": 2,
                   "max_tokens": 24, "temperature": 0, "engine": {"max_batch_size": 16, "max_seq_len": 200}}
        out = tmp_path / "openenv"
        cfg = write_config(tmp_path / "openenv.yaml", "smollm2", rollout=rollout, **SMALL,
                           trainer={"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"], "test_freq": 2})
        assert_ok(run_recipe(cfg, timeout=300))
    metrics = metrics_of(out)
    _check(metrics, max_turns=3)
    # The echo env rewards 0.1 a character echoed: every step turn that produced text scored.
    assert all(m["agent/env_reward/mean"] > 0 and m["agent/observation_tokens/mean"] > 0 for m in metrics)
    # Each observation is the server's echo of the model turn before it, and each echoed turn scored
    # min(1, 0.1 x its characters); the episode's last step (done: no observation) adds at most 1 more.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2
    for s in samples:
        parts = s["trajectory"].split("<|im_end|>\n<|im_start|>user\n")
        echoed = 0.0
        for turn, after in zip(parts, parts[1:]):
            echo = after.split("<|im_end|>", 1)[0]
            assert echo == turn.split("<|im_start|>assistant\n")[-1], s["trajectory"]
            echoed += min(1.0, 0.1 * len(echo))
        assert echoed - 1e-6 <= s["score"] <= echoed + 1.0 + 1e-6, s


def test_verifiers_module_on_smollm2(tmp_path, monkeypatch):
    """tests/agents/vf_word_env.py (verifiers 0.4): an episode per trajectory, its env asking a second time; verifiers
    calls the policy through the rollout worker's endpoint."""
    try:
        if importlib.util.find_spec("verifiers.v1") is None:
            raise ModuleNotFoundError
    except ModuleNotFoundError:
        pytest.skip("needs verifiers 0.4 (pip install 'torchrlhf[verifiers]')")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(AGENTS_TESTS), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "vf"
    agent = {"verifiers": {"env": "vf_word_env", "args": {"num_examples": 4}, "val_args": {"split": "eval"}},
             "reward": "env", "check_tokens": "error"}
    cfg = write_config(tmp_path / "vf.yaml", "smollm2",
                       data={**SMALL["data"], "train_files": [], "val_files": []}, actor=SMALL["actor"],
                       rollout={"agent": agent, "n": 2, "max_tokens": 24, "temperature": 0,
                                "engine": {"max_batch_size": 16, "max_seq_len": 200}},
                       trainer={"total_steps": 2, "output_dir": str(out), "loggers": ["jsonl"], "test_freq": 2})
    assert_ok(run_recipe(cfg, timeout=400))
    metrics = metrics_of(out)
    assert len(metrics) == 2
    for m in metrics:
        assert 1 <= m["num_turns/mean"] and m["num_turns/max"] <= 2  # the env asks twice
        assert m["agent/agent_error/mean"] == 0 and m["agent/harness_splits/mean"] == 0
        assert m["agent/token_mismatches/mean"] == 0  # check_tokens: error also stops the run on one
        assert m["critic/score/mean"] == m["agent/env_reward/mean"]  # reward: env is the episode's trace.reward
    assert (out / "verifiers" / "train.jsonl").read_text().count("\n") == 4
    # The validation rows are the eval split's words (val_args). Each sample's score is the env's reward over its own
    # row's word, recomputed here from the trajectory's model turns: a source that scored another row's task, read
    # the reward from elsewhere, or did not score a trajectory the token budget cut (one turn, finish "length"),
    # would not give these numbers.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and {s["data_source"] for s in samples} == {"vf_word_env"}  # val_max_samples rows
    assert [s["ground_truth"] for s in samples] == ["pearl", "ocean"]
    again = "<|im_start|>user\nSay it again.<|im_end|>\n<|im_start|>assistant\n"
    for s in samples:
        turns = s["trajectory"].split(again)
        assert 1 <= len(turns) <= 2 and all(turns), s
        assert s["score"] == sum(s["ground_truth"] in t.lower() for t in turns) / len(turns), s
    assert any(s["score"] > 0 for s in samples)  # SmolLM2, greedy, says the word it is asked for
    assert metrics[-1]["val/vf_word_env/acc"] == sum(s["score"] for s in samples) / 2
