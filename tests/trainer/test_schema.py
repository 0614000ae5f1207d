"""Recipe configs: every shipped config validates; bad ones fail early with the key, the reason, a fix."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, RECIPE, write_config

from torchrlhf.config import ConfigError, load_config
from torchrlhf.runtime import ParallelDims
from torchrlhf.trainer.schema import load_recipe_config, needs_old_log_prob, role_layouts, role_ranks

CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
WORLD = {"grpo_qwen2p5_7b_8gpu.yaml": 8, "ppo_qwen2p5_0p5b_8gpu.yaml": 8, "grpo_qwen3_30b_a3b_8gpu.yaml": 8}
SHAPES = {"grpo_qwen3_30b_a3b_8gpu.yaml": ROOT / "tools/bench/shapes/qwen3-30b-a3b"}  # its MoE keys read config.json


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory):
    """The GSM8K configs read data/gsm8k/*.jsonl (made by tools/prepare_gsm8k.py); stand-ins will do."""
    d = tmp_path_factory.mktemp("data") / "gsm8k"
    d.mkdir()
    for split in ("train", "test"):
        (d / f"gsm8k_{split}.jsonl").write_text('{"prompt": "1+1?", "ground_truth": "2"}\n')
    return d


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_validates(path, gsm8k_files, monkeypatch):
    monkeypatch.chdir(ROOT)
    raw = load_config(path)
    overrides = []
    if "gsm8k" in str(raw.data.train_files):
        overrides += [f"data.train_files=[{gsm8k_files}/gsm8k_train.jsonl]",
                      f"data.val_files=[{gsm8k_files}/gsm8k_test.jsonl]"]
    if raw.get("teacher") is not None:  # a distillation teacher: a checkpoint the user exports first
        overrides.append("teacher.model_path=smollm2")
    model = SHAPES.get(path.name, gsm8k_files)
    raw = load_config(path, overrides + ([f"model_path={model}"] if "8gpu" in path.name else []))
    cfg = load_recipe_config(raw, WORLD.get(path.name, 2))
    assert cfg.actor.model_path


def _check(tmp_path, tiny=None, world: int = 1, **sections):
    return load_recipe_config(load_config(write_config(tmp_path / "c.yaml", tiny or str(tmp_path), **sections)), world)


@pytest.mark.parametrize("sections, message", [
    ({"actor": {"optim": {"lrr": 1e-3}}}, "actor.optim.lrr: unknown key (did you mean 'lr'?)"),
    ({"actor": {"optim": {"lr": "fast"}}}, "actor.optim.lr: expected float, got 'fast'"),
    ({"trainer": {"total_step": 3}}, "trainer.total_step: unknown key (did you mean 'total_steps'?)"),
    ({"algorithm": {"adv_estimator": "gae"}}, "algorithm.adv_estimator=gae learns against a critic's values: it "
                                              "needs a critic section"),
    ({"algorithm": {"adv_estimator": "grpoo"}}, "algorithm.adv_estimator: unknown 'grpoo'"),
    ({"rollout": {"n": 1}}, "algorithm.adv_estimator=grpo compares the responses of one prompt: rollout.n must be "
                            ">= 2, got 1"),
    ({"algorithm": {"adv_estimator": "remax"}}, "algorithm.adv_estimator=remax samples one response per prompt beside "
                                                "a greedy baseline: set rollout.n=1, got 4"),
    ({"critic": {"model_path": "${model_path}"}}, "a critic is configured but algorithm.adv_estimator=grpo does not "
                                                  "use values; remove the critic section (critic=null) or use an "
                                                  "estimator that does (gae"),
    ({"algorithm": {"adv_estimator": "reinforce_pp", "filter_groups": {"enable": True}}},
     "algorithm.filter_groups.enable (DAPO dynamic sampling) drops groups of equal rewards: it needs a group estimator "
     "("),
    ({"algorithm": {"adv_estimator": "remax"}, "rollout": {"n": 1}, "cost_model": {"model_path": "${model_path}"}},
     "Safe-RLHF (cost_model) estimates the cost's advantage with algorithm.adv_estimator, which here needs what the "
     "cost has not (a value head, a greedy baseline's cost): use one of "),
    ({"actor": {"batching": {"ppo_mini_batch_size": 3}}}, "actor"),
    ({"actor": {"loss": {"agg_mode": "mean"}}}, "actor.loss.agg_mode: unknown 'mean'"),
    ({"actor": {"loss": {"rollout_is": "tokens"}}}, "actor.loss.rollout_is: must be one of ('token', 'sequence') or null"),
    ({"actor": {"loss": {"rollout_is_threshold": -1.0}}}, "actor.loss.rollout_is_threshold: must be positive"),
    ({"rollout": {"engine": {"max_seq_len": 32}}}, "exceeds rollout.engine.max_seq_len (32)"),
    ({"rollout": {"engine": {"max_batch_sise": 8}}}, "rollout.engine.max_batch_sise: unknown key (did you mean "
                                                     "'max_batch_size'?)"),
    ({"rollout": {"engine": {"_component_": "torchrlhf.data.Batch"}}}, "is not a rollout engine class"),
    ({"rollout": {"engine": {"_component_": "torchrlhf.generation.VLLMEngine", "kv_cache_gib": "lots"}}},
     "rollout.engine.kv_cache_gib: expected float, got 'lots'"),
    ({"placement": {"actor": [0], "rollout": [0]}, "rollout": {"tp_size": 2}}, "rollout.tp_size=2 must divide"),
    ({"rollout": {"offload_optimizer": "sometimes"}}, "rollout.offload_optimizer: expected bool, got 'sometimes'"),
    ({"actor": {"moe": {"router_replay": "rollout"}}}, "actor.moe.router_replay=rollout needs rollout.engine.record_routes=true"),
    ({"actor": {"moe": {"router_replay": "rollout"}}, "rollout": {"engine": {"_component_": "torchrlhf.generation.VLLMEngine"}}},
     "VLLMEngine does not return them"),
    ({"data": {"train_files": ["nowhere.jsonl"]}}, "data.train_files: no such file(s) ['nowhere.jsonl']"),
    ({"placement": {"critic": [0, 5]}, "algorithm": {"adv_estimator": "gae"},
      "critic": {"model_path": "${model_path}", "batching": {"ppo_mini_batch_size": 4}}}, "placement.critic: ranks [0, 5]"),
    ({"trainer": {"profile": {"roles": ["ref"]}}}, "trainer.profile.roles: ['ref'] not in this run; its roles: "
                                                   "['actor', 'rollout']"),
    ({"trainer": {"profile": {"steps": [0]}}}, "trainer.profile.steps: must be >= 1"),
    ({"trainer": {"total_steps": 2, "profile": {"steps": [2, 3]}}},
     "trainer.profile.steps: [3] after the last step (trainer.total_steps=2)"),
    ({"trainer": {"profile": {"step": [1]}}}, "trainer.profile.step: unknown key (did you mean 'steps'?)"),
    ({"judge": {"model_path": "${model_path}", "parser": {"regex": "(x"}}}, "judge.parser.regex: '(x' is not a "
                                                                             "regular expression"),
    ({"judge": {"model_path": "${model_path}", "parser": {"regex": "x", "fn": "json:loads"}}},
     "judge.parser.fn: set regex or fn, not both"),
    ({"judge": {"model_path": "${model_path}", "sampling": {"top_p": 0.0}}}, "judge.sampling.top_p: must be in (0, 1]"),
    ({"judge": {"model_path": "${model_path}", "parser_regex": "x"}}, "judge.parser_regex: moved to judge.parser.regex"),
    # keys from before the loss sections: the error names the new key
    ({"actor": {"policy_loss": "gspo"}}, "actor.policy_loss: moved to actor.loss.policy_loss"),
    ({"actor": {"loss_agg_mode": "token-mean"}}, "actor.loss_agg_mode: moved to actor.loss.agg_mode"),
    ({"actor": {"grad_clip": 0.5}}, "actor.grad_clip: moved to actor.optim.clip_grad"),
    ({"actor": {"router_aux_loss_coef": 0.001}}, "actor.router_aux_loss_coef: moved to actor.moe.aux_loss_coef"),
    ({"actor": {"router_replay": "rollout"}}, "actor.router_replay: moved to actor.moe.router_replay"),
    ({"actor": {"moe": {"router_replay": "engine"}}}, "router_replay: 'off' or 'rollout', got 'engine'"),
    ({"actor": {"shared_prefix": False, "memory": {"offload_prefix_activations": True}}},
     "actor.memory.offload_prefix_activations needs actor.shared_prefix: true"),
    ({"actor": {"activation_checkpointing": True}}, "actor.activation_checkpointing: moved to "
                                                    "actor.memory.activation_checkpointing"),
    ({"critic": {"model_path": "${model_path}", "cpu_offload": True}},
     "critic.cpu_offload: moved to critic.memory.cpu_offload"),
    ({"actor": {"rollout_n": 4}}, "actor.rollout_n: unknown key"),
    ({"actor": {"run": {"rollout_n": 4}}}, "actor.run: unknown key"),
    ({"critic": {"model_path": "${model_path}", "cliprange_value": 0.2}},
     "critic.cliprange_value: moved to critic.loss.cliprange_value"),
    # the algorithm's, the trainer's checkpoint and the agent's keys that became sections
    ({"algorithm": {"kl_coef": 0.01}}, "algorithm.kl_coef: moved to algorithm.kl_ctrl.kl_coef"),
    ({"algorithm": {"kl_target": 0.1}}, "algorithm.kl_target: moved to algorithm.kl_ctrl.target_kl"),
    ({"algorithm": {"filter_groups": True}}, "algorithm.filter_groups: moved to algorithm.filter_groups.enable"),
    ({"algorithm": {"overlong_buffer_len": 4}}, "algorithm.overlong_buffer_len: moved to algorithm.overlong_buffer.len"),
    ({"algorithm": {"cost_threshold": 0.5}}, "algorithm.cost_threshold: moved to algorithm.lagrangian.threshold"),
    ({"algorithm": {"lagrangian_max": 10.0}}, "algorithm.lagrangian_max: moved to algorithm.lagrangian.max_value"),
    ({"trainer": {"save_freq": 5}}, "trainer.save_freq: moved to trainer.checkpoint.save_freq"),
    ({"trainer": {"keep_last_checkpoints": 2}}, "trainer.keep_last_checkpoints: moved to trainer.checkpoint.keep_last"),
    ({"trainer": {"resume": "disable"}}, "trainer.resume: moved to trainer.checkpoint.resume"),
    ({"rollout": {"agent": {"harness": "m:f", "harness_timeout_s": 5, "reward": "env"}}},
     "rollout.agent.harness: moved to rollout.agent.harness.fn\n  - rollout.agent.harness_timeout_s: moved to "
     "rollout.agent.harness.timeout_s"),
    ({"rollout": {"agent": {"tools": ["calculator"], "format": "tags", "max_parallel_calls": 2}}},
     "rollout.agent.format: moved to rollout.agent.tool_calls.format\n  - rollout.agent.max_parallel_calls: moved "
     "to rollout.agent.tool_calls.max_parallel"),
    ({"rollout": {"agent": {"tools": ["calculator"], "observation_role": "user"}}},
     "rollout.agent.observation_role: moved to rollout.agent.observation.role"),
    # a section checks its own keys, named by their full path
    ({"algorithm": {"kl_ctrl": {"type": "adaptive", "target_kl": 0.0}}},
     "algorithm.kl_ctrl.target_kl: must be > 0 (type adaptive), got 0.0"),
    ({"algorithm": {"kl_ctrl": {"type": "pid"}}}, "algorithm.kl_ctrl.type: expected one of ['fixed', 'adaptive']"),
    ({"algorithm": {"lagrangian": {"init": -1.0}}}, "algorithm.lagrangian.init: must be >= 0, got -1.0"),
    ({"algorithm": {"overlong_buffer": {"len": -1}}}, "algorithm.overlong_buffer.len: must be >= 0 (0: off), got -1"),
    ({"algorithm": {"overlong_buffer": {"len": 16}}}, "algorithm.overlong_buffer.len (16) exceeds rollout.max_tokens (8)"),
    ({"trainer": {"checkpoint": {"keep_lst": 2}}}, "trainer.checkpoint.keep_lst: unknown key (did you mean "
                                                   "'keep_last'?)"),
    ({"trainer": {"checkpoint": {"snapshot_freq": -1}}}, "trainer.checkpoint.snapshot_freq: must be >= 0 (0: off), "
                                                         "got -1"),
    ({"trainer": {"checkpoint": {"snapshot_peer": True}}}, "trainer.checkpoint.snapshot_peer: copies memory snapshots "
                                                           "to another node; set snapshot_freq > 0 too"),
    ({"judge": {"model_path": "${model_path}", "template": "{answer}"}}, "judge.template: may use only the fields"),
    # the judge's engine has the rollout engine's schema: a typo fails here, not on the judge's ranks
    ({"judge": {"model_path": "${model_path}", "engine": {"max_batch_sise": 8}}},
     "judge.engine.max_batch_sise: unknown key (did you mean 'max_batch_size'?)"),
    ({"judge": {"model_path": "${model_path}", "engine": {"_component_": "torch.nn.Linear"}}},
     "judge.engine._component_: 'torch.nn.Linear' is not a rollout engine class"),
])
def test_bad_config_is_refused_with_the_key(tmp_path, sections, message):
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, **sections)
    assert message in str(e.value), str(e.value)


def test_offloading_more_than_the_host_holds_is_refused_at_start_up(tmp_path, tiny_model_dir, monkeypatch):
    """The prompts' pass of a mini-batch (4 prompts of 64 tokens on one rank) is traced; what it saves is
    compared with the host memory a rank may use, here made 1 MiB, then 1 GiB."""
    import torchrlhf.trainer.schema as schema

    monkeypatch.setattr(schema, "host_bytes_available", lambda: 2**20)
    with pytest.raises(ConfigError, match=r"actor.memory.offload_prefix_activations: a mini-batch's prompts' pass \(4 prompt\(s\) "
                                          r"of 64 tokens per rank\) saves [\d.]+ GiB, more than the 0.00 GiB of host"):
        _check(tmp_path, tiny_model_dir, actor={"memory": {"offload_prefix_activations": True}})
    monkeypatch.setattr(schema, "host_bytes_available", lambda: 2**30)
    cfg = _check(tmp_path, tiny_model_dir, actor={"memory": {"offload_prefix_activations": True}})
    assert cfg.actor.memory.offload_prefix_activations


def test_moe_keys_are_checked_against_the_models_config(tmp_path, tiny_model_dir):
    from torchrlhf.models import save_tiny_model

    with pytest.raises(ConfigError, match=r"actor.ep_size: the actor's model \(llama\) is not a mixture-of-experts"):
        _check(tmp_path, tiny_model_dir, world=2, actor={"ep_size": 2})
    moe = str(save_tiny_model(tmp_path / "moe", family="qwen3_moe", num_experts=6, tokenizer_from="smollm2"))
    with pytest.raises(ConfigError, match="actor.ep_size=4 must divide the model's 6 experts"):
        _check(tmp_path, moe, world=4, actor={"ep_size": 4})
    with pytest.raises(ConfigError, match="actor.ep_size=3: expert-parallel size 3 must divide the group's 4"):
        _check(tmp_path, moe, world=4, actor={"ep_size": 3})
    cfg = _check(tmp_path, moe, world=4, actor={"ep_size": 2, "batching": {"ppo_micro_batch_size_per_device": 4}})
    assert cfg.actor.ep_size == 2
    with pytest.raises(ConfigError, match="actor.tp_size=2: training has no tensor-parallel plan for qwen3_moe"):
        _check(tmp_path, moe, world=2, actor={"tp_size": 2})
    # the engine splits the experts over its TP ranks: a TP-2 rollout beside a TP-1 actor is a valid config
    cfg = _check(tmp_path, moe, world=2, rollout={"tp_size": 2},
                 actor={"batching": {"ppo_micro_batch_size_per_device": 4}})
    assert cfg.rollout.tp_size == 2


@pytest.mark.parametrize("sections, message", [
    ({}, "trainer.mode=async generates while the actor trains: give the rollout ranks of its own"),
    ({"placement": {"actor": [0], "rollout": [1]}, "async_training": {"max_staleness": -1}},
     "async_training.max_staleness must be >= 0, got -1"),
    ({"placement": {"actor": [0], "rollout": [1]}, "async_training": {"prompts_per_call": 5}},
     "async_training.prompts_per_call must be in [1, data.train_batch_size=4], got 5"),
    ({"placement": {"actor": [0], "rollout": [1]}, "async_training": {"schedule": "fast"}},
     "async_training.schedule"),
    ({"placement": {"actor": [0], "rollout": [1]}, "algorithm": {"filter_groups": {"enable": True}},
      "reward_model": {"model_path": "${model_path}"}},
     "algorithm.filter_groups.enable (DAPO dynamic sampling) with trainer.mode=async needs each sample's full score on the "
     "rollout thread"),
    ({"placement": {"actor": [0], "rollout": [1]}, "algorithm": {"adv_estimator": "remax"},
      "reward_model": {"model_path": "${model_path}"}, "rollout": {"n": 1}},
     "algorithm.adv_estimator=remax (a greedy baseline) with trainer.mode=async needs each sample's full score"),
    ({"placement": {"actor": [0], "rollout": [1]},
      "async_training": {"partial_rollout": True, "schedule": "deterministic"}},
     "async_training.partial_rollout needs async_training.schedule=stream and rollout.tp_size=1"),
    ({"placement": {"actor": [0], "rollout": [1]}, "async_training": {"partial_rollout": True},
      "rollout": {"engine": {"_component_": "torchrlhf.generation.VLLMEngine"}}},
     "async_training.partial_rollout needs a rollout engine that can load newer weights between two decode steps "
     "(between_steps) and record each token's weight version (token_weight_versions); VLLMEngine does not declare "
     "'partial_rollout' in its capabilities"),
    ({"placement": {"actor": [0], "rollout": [1]}, "async_training": {"repack": {"enable": True}}},
     "async_training.repack.long_tail_replicas=1 needs more rollout replicas than that; placement.rollout has 1"),
    ({"placement": {"actor": [0], "rollout": [1, 2]},
      "async_training": {"repack": {"enable": True}, "schedule": "deterministic"}},
     "async_training.repack moves samples between the stream schedule's calls: set async_training.schedule=stream"),
    ({"placement": {"actor": [0], "rollout": [1, 2]}, "async_training": {"repack": {"enable": True}},
      "algorithm": {"adv_estimator": "remax"}, "rollout": {"n": 1}},
     "async_training.repack continues single-turn samples only; it does not support algorithm.adv_estimator=remax"),
    ({"placement": {"actor": [0], "rollout": [1, 2]}, "async_training": {"repack": {"enable": True}},
      "rollout": {"engine": {"_component_": "torchrlhf.generation.VLLMEngine"}}},
     "async_training.repack.enable needs a rollout engine that can hand back its unfinished samples"),
    ({"placement": {"actor": [0], "rollout": [1, 2]}, "async_training": {"repack": {"min_active_fraction": 0}}},
     "async_training.repack.min_active_fraction: must be in (0, 1], got 0"),
])
def test_bad_async_config_is_refused(tmp_path, sections, message):
    world = 1 + max(sections.get("placement", {}).get("rollout", [1]))
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, world=world, trainer={"mode": "async"}, **sections)
    assert message in str(e.value), str(e.value)


def test_repack_in_a_synchronous_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="async_training.repack moves samples between asynchronous rollout calls: "
                                          "set trainer.mode=async"):
        _check(tmp_path, world=3, placement={"actor": [0], "rollout": [1, 2]},
               async_training={"repack": {"enable": True}})


@pytest.mark.parametrize("sections", [
    {"algorithm": {"filter_groups": {"enable": True}}, "async_training": {"schedule": "deterministic"}},
    {"algorithm": {"adv_estimator": "remax"}, "async_training": {"schedule": "deterministic"}, "rollout": {"n": 1},
     "actor": {"batching": {"ppo_micro_batch_size_per_device": 4}}},
    {"algorithm": {"filter_groups": {"enable": True}}, "reward_model": {"model_path": "${model_path}"},
     "placement": {"actor": [0], "rollout": [1, 2], "reward_model": [2]}},
])
def test_async_runs_what_the_one_rollout_path_allows(tmp_path, sections):
    """DAPO and ReMax with either schedule, and with a reward model the rollout threads may call (not on the
    ranks of a role that trains meanwhile)."""
    placement = sections.pop("placement", {"actor": [0], "rollout": [1]})
    cfg = _check(tmp_path, world=len({r for ranks in placement.values() for r in ranks}),
                 trainer={"mode": "async"}, placement=placement, **sections)
    assert cfg.trainer.mode == "async"


def test_rollout_ranks_either_match_the_actors_or_are_their_own(tmp_path):
    with pytest.raises(ConfigError, match=r"placement.rollout \[1, 2\] overlaps placement.actor \[0, 1\]"):
        _check(tmp_path, world=3, placement={"actor": [0, 1], "rollout": [1, 2]},
               actor={"batching": {"ppo_micro_batch_size_per_device": 4}})


def test_every_problem_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, actor={"lrr": 1, "dtyp": "bf16"})
    assert "actor.lrr" in str(e.value) and "actor.dtyp" in str(e.value)


@pytest.mark.parametrize("agent, message", [
    ({"tools": ["no_such_tool"]}, "rollout.agent.tools:"),
    ({"env": {"_component_": "torchrlhf.data.Batch"}}, "rollout.agent.env:"),
    ({"tool_calls": {"format": "xml"}, "tools": ["calculator"]}, "rollout.agent.tool_calls.format: must be 'hermes' or "
                                                                  "'tags'"),
    ({}, "rollout.agent: needs tools, an env, verifiers or a harness"),
    ({"harness": {"fn": "no_such_module:run_agent"}, "reward": "env"}, "rollout.agent.harness.fn:"),
    ({"harness": {"fn": "m:f", "timeout_s": 0}, "reward": "env"}, "rollout.agent.harness.timeout_s: must be > 0, got 0"),
    ({"tools": ["calculator"], "observation": {"role": "system"}},
     "rollout.agent.observation.role: must be 'auto', 'tool' or 'user', got 'system'"),
])
def test_a_bad_agent_is_refused_before_anything_loads(tmp_path, agent, message):
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, rollout={"agent": agent})
    assert message in str(e.value), str(e.value)


def test_an_agent_needs_one_rank_per_engine(tmp_path):
    with pytest.raises(ConfigError, match="rollout.agent runs with rollout.tp_size=1"):
        _check(tmp_path, world=2, rollout={"tp_size": 2, "agent": {"tools": ["calculator"]}})


@pytest.mark.parametrize("engine, rollout, message", [
    ("SingleTurnEngine", {"agent": {"tools": ["calculator"]}},
     "rollout.agent needs a rollout engine that can run multi-turn agent sessions (sessions=): natively, or in rounds "
     "of single-turn calls with torchrlhf.generation.base.generate_in_rounds; SingleTurnEngine does not declare "
     "'agent_sessions' in its capabilities"),
    ("StaleEngine", {}, "rollout.engine._component_: 'custom_components.StaleEngine' declares ['agent_sessions', "
                        "'partial_rollout', 'repack'] but its generate takes no ['sessions', 'between_steps', "
                        "'release_below'] argument"),
])
def test_an_engine_is_checked_by_the_capabilities_it_declares(tmp_path, monkeypatch, engine, rollout, message):
    """A custom engine's capabilities (`torchrlhf.generation.CAPABILITIES`) are checked at config time, not at its
    first generate: what the config asks for, and that its generate takes the arguments they add."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, rollout={"engine": {"_component_": f"custom_components.{engine}"}, **rollout})
    assert message in str(e.value), str(e.value)
    assert _check(tmp_path, rollout={"engine": {"_component_": "custom_components.SingleTurnEngine"}})  # no agent


def test_a_missing_model_and_missing_data_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, tiny=str(tmp_path / "no_model"), data={"train_files": ["nowhere.jsonl"]})
    assert "data.train_files: no such file(s) ['nowhere.jsonl']" in str(e.value)
    assert f"actor.model_path: model path does not exist: {tmp_path / 'no_model'}" in str(e.value)


def test_placement_colocates_by_default_and_splits_on_request(tmp_path):
    critic = {"model_path": "${model_path}", "batching": {"ppo_mini_batch_size": 4}}
    actor = {"batching": {"ppo_micro_batch_size_per_device": 4}}
    cfg = _check(tmp_path, world=4, algorithm={"adv_estimator": "gae", "use_kl_in_reward": True}, critic=critic,
                 actor=actor)
    everywhere = [0, 1, 2, 3]
    assert role_ranks(cfg, 4) == {"actor": everywhere, "rollout": everywhere, "ref": everywhere, "critic": everywhere}
    cfg = _check(tmp_path, world=4, algorithm={"adv_estimator": "gae"}, critic=critic, actor=actor,
                 placement={"actor": [0, 1], "critic": [2, 3]})
    assert role_ranks(cfg, 4) == {"actor": [0, 1], "rollout": [0, 1], "critic": [2, 3]}
    cfg = _check(tmp_path, world=4, placement={"actor": [0, 1], "rollout": [2, 3]}, actor=actor)
    assert role_ranks(cfg, 4) == {"actor": [0, 1], "rollout": [2, 3]}


def test_each_role_is_laid_out_once_on_the_controller(tmp_path):
    """`role_layouts`: each role's ranks and how they divide into data-parallel replicas of TP ranks, the value the
    config check, the dry run and the worker groups read. The reference takes the actor's TP; a rollout colocated
    with the actor takes one prompt shard per rank, one on ranks of its own one engine per ``rollout.tp_size``."""
    actor = {"tp_size": 2, "batching": {"ppo_micro_batch_size_per_device": 4}}
    cfg = _check(tmp_path, world=4, algorithm={"use_kl_in_reward": True}, actor=actor, rollout={"tp_size": 2})
    layouts = role_layouts(cfg, 4)
    assert {role: (list(lay.ranks), lay.dims) for role, lay in layouts.items()} == {
        "actor": ([0, 1, 2, 3], ParallelDims(4, tp=2)), "ref": ([0, 1, 2, 3], ParallelDims(4, tp=2)),
        "rollout": ([0, 1, 2, 3], ParallelDims(4))}
    cfg = _check(tmp_path, world=4, placement={"actor": [0, 1], "rollout": [2, 3]}, actor={**actor, "tp_size": 1},
                 rollout={"tp_size": 2})
    layouts = role_layouts(cfg, 4)
    assert (layouts["actor"].dims, layouts["rollout"].dims, layouts["rollout"].ranks) == (
        ParallelDims(2), ParallelDims(2, tp=2), (2, 3))
    with pytest.raises(ConfigError, match=r"actor.tp_size=3 must divide the actor's 4 ranks \(placement.actor\)"):
        _check(tmp_path, world=4, actor={**actor, "tp_size": 3})


@pytest.mark.parametrize("overrides,expected", [
    ({}, False),  # one epoch, one mini-batch: the update's own log-probs, detached
    ({"actor": {"batching": {"ppo_epochs": 2}}}, True),
    ({"actor": {"batching": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 8}}}, True),
    ({"algorithm": {"use_kl_in_reward": True}}, True),  # the KL penalty compares them with the reference's
])
def test_the_old_log_prob_forward_runs_when_the_update_is_not_on_policy_or_kl_needs_it(tmp_path, overrides, expected):
    assert needs_old_log_prob(_check(tmp_path, world=1, **overrides)) is expected


def test_the_optimizer_offload_setting_reaches_the_colocated_rollout_worker(tmp_path):
    """``rollout.offload_optimizer`` is the rollout worker's constructor argument (what it does on a GPU:
    tests/hybrid/test_mode_cuda.py)."""
    from torchrlhf.trainer.build import role_specs

    assert role_specs(_check(tmp_path), 1)["rollout"][2]["offload_optimizer"] is True
    kept = role_specs(_check(tmp_path, rollout={"offload_optimizer": False}), 1)["rollout"]
    assert kept[2]["offload_optimizer"] is False and kept[2]["actor_group"] == "actor"


def test_cli_bad_key_exits_2_before_any_work(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", "/models/tiny", trainer={"output_dir": str(tmp_path / "out")})
    proc = subprocess.run([sys.executable, str(RECIPE), "--config", str(cfg), "actor.optim.lr=1",
                           "algorithm.kl_ctrl.kl_coeff=0.1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert "algorithm.kl_ctrl.kl_coeff: unknown key (did you mean 'kl_coef'?)" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_component_sections_take_the_subclass_arguments(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    cfg = _check(tmp_path, actor={"_component_": "custom_components.MarkedActor", "marker": 2.0},
                 reward={"_component_": "custom_components.ShiftedRewardManager", "score_shift": 1.5, "timeout_s": 3.0})
    assert cfg.actor.marker == 2.0 and cfg.actor._component_ == "custom_components.MarkedActor"
    assert cfg.reward.score_shift == 1.5 and cfg.reward.timeout_s == 3.0  # the base class's arguments too
    assert _check(tmp_path).actor._component_ == "torchrlhf.workers.actor.ActorWorker"  # the default


@pytest.mark.parametrize("sections, message", [
    ({"actor": {"marker": 2.0}}, "actor.marker: unknown key"),  # only the subclass takes it
    ({"actor": {"_component_": "custom_components.MarkedActor", "markr": 2.0}},
     "actor.markr: unknown key (did you mean 'marker'?)"),
    ({"actor": {"_component_": "custom_components.NotAWorker"}},
     "actor._component_: 'custom_components.NotAWorker' must be a subclass of torchrlhf.workers.actor.ActorWorker"),
    ({"reward": {"_component_": "custom_components.NoSuchManager"}}, "reward._component_: cannot import component"),
])
def test_bad_component_is_refused(tmp_path, monkeypatch, sections, message):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, **sections)
    assert message in str(e.value), str(e.value)


def test_a_users_estimator_is_checked_by_the_traits_it_registers(tmp_path, monkeypatch):
    """`custom_components.best_of_group` registers itself with group=True: the checks know it from that alone."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    importlib.import_module("custom_components")
    assert _check(tmp_path, algorithm={"adv_estimator": "best_of_group"}).algorithm.adv_estimator == "best_of_group"
    with pytest.raises(ConfigError) as e:
        _check(tmp_path, algorithm={"adv_estimator": "best_of_group"}, rollout={"n": 1},
               critic={"model_path": "${model_path}"})
    assert "algorithm.adv_estimator=best_of_group compares the responses of one prompt: rollout.n must be >= 2, " \
           "got 1" in str(e.value)
    assert "a critic is configured but algorithm.adv_estimator=best_of_group does not use values" in str(e.value)
    with pytest.raises(ConfigError, match=r"needs a group estimator \(best_of_group, dr_grpo, .*\), not reinforce_pp"):
        _check(tmp_path, algorithm={"adv_estimator": "reinforce_pp", "filter_groups": {"enable": True}})


def test_checked_sections_cross_to_the_workers_as_themselves(tmp_path):
    """`PolicyLoss`, `Batching` and the judge's `ParserSpec` / `JudgeSampling` are checked once, at validation, and
    reach the worker constructors as those objects (a generated schema, not picklable, travels as a dict)."""
    from torchrlhf.algorithms import PolicyLoss
    from torchrlhf.rewards.judge import ParserSpec
    from torchrlhf.trainer.schema import section_kwargs
    from torchrlhf.workers.judge import JudgeSampling
    from torchrlhf.workers.microbatch import Batching

    cfg = _check(tmp_path, actor={"loss": {"policy_loss": "gspo", "agg_mode": "seq-mean-token-mean"},
                                  "optim": {"clip_grad": 0.5}},
                 judge={"model_path": "${model_path}", "parser": {"regex": r"(\d)"}, "sampling": {"max_tokens": 4}})
    actor = section_kwargs(cfg, "actor")
    assert actor["loss"] == PolicyLoss(policy_loss="gspo", agg_mode="seq-mean-token-mean")
    assert isinstance(actor["batching"], Batching)
    assert isinstance(actor["optim"], dict) and actor["optim"]["clip_grad"] == 0.5
    judge = section_kwargs(cfg, "judge")
    assert judge["parser"] == ParserSpec(regex=r"(\d)") and judge["sampling"] == JudgeSampling(max_tokens=4)


def test_algorithm_trainer_and_agent_sections_are_typed_and_cross_to_the_workers_as_themselves(tmp_path):
    """The ``algorithm`` sections (`KLControl`, `FilterGroups`, `OverlongBuffer`, `Lagrangian`), ``trainer.checkpoint``
    and the agent's (``tool_calls``, ``observation``, ``harness``) are their classes, with the old flat defaults;
    the rollout workers receive the `AgentSpec` with its sections as they are, through a pickle."""
    import pickle

    from torchrlhf.agents.agent import AgentSpec, HarnessSpec, ObservationSpec, ToolCallSpec
    from torchrlhf.algorithms import FilterGroups, KLControl, Lagrangian, OverlongBuffer
    from torchrlhf.trainer.build import role_specs
    from torchrlhf.trainer.config import CheckpointConfig

    defaults = _check(tmp_path)
    assert defaults.algorithm.kl_ctrl == KLControl(type="fixed", kl_coef=0.001, target_kl=0.1, horizon=10000)
    assert defaults.algorithm.filter_groups == FilterGroups(enable=False, max_num_gen_batches=10)
    assert defaults.algorithm.overlong_buffer == OverlongBuffer(len=0, penalty_factor=1.0)
    assert defaults.algorithm.lagrangian == Lagrangian(init=1.0, lr=0.05, threshold=0.0, max_value=None)
    assert defaults.trainer.checkpoint == CheckpointConfig(save_freq=0, keep_last=None, resume="auto",
                                                           snapshot_freq=0, snapshot_dir=None, snapshot_peer=False)
    cfg = _check(tmp_path, algorithm={"kl_ctrl": {"type": "adaptive", "kl_coef": 0.01}},
                 trainer={"checkpoint": {"save_freq": 2, "keep_last": 1}},
                 rollout={"agent": {"tools": ["calculator"], "tool_calls": {"format": "tags", "tags": {"c": "calculator"},
                                                                            "max_parallel": 2},
                                    "observation": {"role": "user", "prefix": "> "}}})
    assert cfg.algorithm.kl_ctrl.controller().value == 0.01 and cfg.trainer.checkpoint.keep_last == 1
    agent = role_specs(cfg, 1)["rollout"][2]["agent"]
    assert agent is cfg.rollout.agent and pickle.loads(pickle.dumps(agent)) == agent
    assert agent.tool_calls == ToolCallSpec(format="tags", tags={"c": "calculator"}, max_parallel=2)
    assert agent.observation == ObservationSpec(role="user", prefix="> ") and agent.harness == HarnessSpec()
    assert AgentSpec(tools=("calculator",), harness=None).harness.fn is None  # harness: null, no harness
