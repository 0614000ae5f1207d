"""verifiers environments (`torchrlhf.agents.verifiers_env`) stepped by our session: `vf_word_env` is a module written
in the shape verifiers' docs give. Needs ``verifiers`` 0.1.x (skips without it)."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("verifiers")

from torchrlhf.agents import AgentSession, AgentSpec, build_agent  # noqa: E402
from torchrlhf.agents.verifiers_env import verifiers_data_files  # noqa: E402
from torchrlhf.config import ConfigError  # noqa: E402

IM_END = 2
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORD_ENV = {"env": "vf_word_env", "args": {"num_examples": 2}}


def turn(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [IM_END]


def first_row(tmp_path) -> dict:
    (train,), _ = verifiers_data_files(WORD_ENV, str(tmp_path), [])
    row = json.loads(open(train).readline())
    return {**row, "messages": row["prompt"]}


def test_dataset_becomes_prompt_files(tmp_path):
    train, val = verifiers_data_files(WORD_ENV, str(tmp_path), [])
    rows = [json.loads(line) for line in open(train[0])]
    assert rows[1] == {"prompt": [{"role": "system", "content": "You repeat words."},
                                  {"role": "user", "content": "Say the word 'river'."}],
                       "ground_truth": "river", "data_source": "vf_word_env"}
    assert val == [str(tmp_path / "verifiers" / "val.jsonl")]  # the eval dataset validates
    assert verifiers_data_files(WORD_ENV, str(tmp_path), ["mine.jsonl"])[1] == ["mine.jsonl"]  # given files win


def test_multi_turn_protocol_and_rubric_reward(smollm2_tok, tmp_path):
    agent = build_agent({"verifiers": WORD_ENV, "reward": "env", "max_turns": 4, "check_tokens": "metric"},
                        smollm2_tok, max_tokens=60)
    s = AgentSession(agent, first_row(tmp_path))
    assert s.env.state["info"] == {"index": 0} and s.env.state["answer"] == "apple"  # the row's own info
    r = s.end_turn(turn(smollm2_tok, "apple"), "stop").result()
    # env_response's message, rendered as the chat template's delta after the model's turn
    assert smollm2_tok.decode(r.observation_tokens) == "\n<|im_start|>user\nSay it again.<|im_end|>\n<|im_start|>assistant\n"
    last = s.end_turn(turn(smollm2_tok, "pear"), "stop").result()
    assert last.done and last.reward == 0.5  # the rubric: 1 of the 2 turns says the word
    traj = s.result()
    assert traj.finish_reason == "env_done" and s.final_reward() == 0.5 and traj.metrics["token_mismatches"] == 0


def test_tool_env_calls_from_hermes_text(smollm2_tok, tmp_path):
    env = {"env": "vf_word_env", "args": {"num_examples": 2, "tools": True}}
    agent = build_agent({"verifiers": env, "reward": "env"}, smollm2_tok, max_tokens=80)
    s = AgentSession(agent, first_row(tmp_path))
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert "\n5<|im_end|>" in smollm2_tok.decode(s.end_turn(turn(smollm2_tok, call), "stop").result().observation_tokens)
    unknown = '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'  # ToolEnv's own error message
    assert "'mul'" in smollm2_tok.decode(s.end_turn(turn(smollm2_tok, unknown), "stop").result().observation_tokens)
    last = s.end_turn(turn(smollm2_tok, "apple"), "stop").result()  # no tool call: the ToolEnv is done
    assert last.done and last.reward == pytest.approx(1 / 3)


def test_a_module_file_from_the_project_folder_runs_the_calculator_recipe_env(smollm2_tok, tmp_path):
    """``env: path/to/module.py`` loads a module that is not installed: here the demo's recipes/envs/vf_calculator.py."""
    calc = {"env": os.path.join(REPO, "recipes", "envs", "vf_calculator.py"), "args": {"num_train": 2, "num_eval": 2}}
    (train,), (val,) = verifiers_data_files(calc, str(tmp_path), [])
    row = json.loads(open(train).readline())
    assert row["prompt"][-1] == {"role": "user", "content": "What is 124 * 76 * 74 * 24?"}  # after the few-shot exchange
    assert row["ground_truth"] == "16737024" and row["data_source"] == "vf_calculator"  # the file's stem names the metric
    agent = build_agent({"verifiers": calc, "reward": "env", "max_turns": 3, "check_tokens": "error"}, smollm2_tok,
                        max_tokens=60)
    s = AgentSession(agent, {**row, "messages": row["prompt"]})
    r = s.end_turn(turn(smollm2_tok, "<calc>124 * 76 * 74 * 24</calc>"), "stop").result()
    assert smollm2_tok.decode(r.observation_tokens) == "\n<|im_start|>user\n16737024<|im_end|>\n<|im_start|>assistant\n"
    last = s.end_turn(turn(smollm2_tok, "The answer is 16737024."), "stop").result()
    assert last.done and last.reward == 1.0  # a turn without <calc> ends the episode; the rubric checks the answer
    s = AgentSession(agent, {**row, "messages": row["prompt"]})
    assert s.end_turn(turn(smollm2_tok, "The answer is 16737."), "stop").result().reward == 0.0


@pytest.mark.parametrize("cfg,match", [
    ({"verifiers": {"env": "no_such_vf_env"}, "reward": "env"}, "Could not import 'no_such_vf_env'"),
    ({"verifiers": {"env": "envs/missing_env.py"}, "reward": "env"}, "file not found: envs/missing_env.py"),
    ({"verifiers": WORD_ENV}, "the rubric scores the trajectory; set reward: env"),
    ({"verifiers": WORD_ENV, "env": {"_component_": "x.Y"}, "reward": "env"}, "set env or verifiers, not both"),
    ({"verifiers": {"name": "vf_word_env"}, "reward": "env"}, "verifiers must be {env: NAME, args:"),
])
def test_config_errors(cfg, match):
    with pytest.raises(ConfigError, match=match):
        AgentSpec.from_config(cfg)
