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
    return row


def test_dataset_becomes_prompt_files(tmp_path):
    train, val = verifiers_data_files(WORD_ENV, str(tmp_path), [])
    rows = [json.loads(line) for line in open(train[0])]
    assert rows[1] == {"prompt": [{"role": "system", "content": "You repeat words."},
                                  {"role": "user", "content": "Say the word 'river'."}],
                       "ground_truth": "river", "data_source": "vf_word_env",
                       "answer": "river", "task": "default", "info": {"index": 1}, "verifiers_index": 1}
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


def test_rows_sharing_a_prompt_keep_their_own_answer_and_info(smollm2_tok, tmp_path):
    """A game whose secret is only in ``answer``: every row has one prompt text. Each trajectory is hinted and scored
    with its own row's answer and info, validation rows with theirs (they were all the first row's when rows were
    found again by their prompt text)."""
    env = {"env": "vf_word_env", "args": {"num_examples": 3, "secret": True}}
    (train,), (val,) = verifiers_data_files(env, str(tmp_path), [])
    agent = build_agent({"verifiers": env, "reward": "env", "max_turns": 4}, smollm2_tok, max_tokens=60)
    for path, words, first in ((train, ["apple", "river", "stone"], 0), (val, ["pearl", "ocean", "maple"], 100)):
        rows = [json.loads(line) for line in open(path)]
        assert len({json.dumps(row["prompt"]) for row in rows}) == 1  # the prompt text tells no row apart
        for i, (row, word) in enumerate(zip(rows, words)):
            s = AgentSession(agent, row)  # as the rollout worker makes it: the data file's row as read
            assert s.env.state["answer"] == word and s.env.state["info"] == {"index": first + i}
            s.end_turn(turn(smollm2_tok, word), "stop").result()
            assert s.end_turn(turn(smollm2_tok, word), "stop").result().reward == 1.0 and s.final_reward() == 1.0


def test_an_episode_the_session_ends_is_scored_by_the_rubric(smollm2_tok, tmp_path):
    """Cut by the token budget, or by our ``max_turns`` before the environment's: the rubric scores the episode as it
    stands, the cut turn included (it scored 0.0 without the rubric, and counted nowhere)."""
    row = json.loads(open(verifiers_data_files(WORD_ENV, str(tmp_path), [])[0][0]).readline())
    agent = build_agent({"verifiers": WORD_ENV, "reward": "env", "max_turns": 4}, smollm2_tok, max_tokens=60)
    s = AgentSession(agent, row)
    cut = s.end_turn(smollm2_tok.encode("apple, apple and", add_special_tokens=False), "length").result()
    assert cut.done and cut.reward == 1.0 and s.final_reward() == 1.0 and s.result().finish_reason == "length"
    assert s.env.completion[-1] == {"role": "assistant", "content": "apple, apple and"}

    one_turn = build_agent({"verifiers": WORD_ENV, "reward": "env", "max_turns": 1}, smollm2_tok, max_tokens=60)
    s = AgentSession(one_turn, row)
    assert s.end_turn(turn(smollm2_tok, "apple"), "stop").result().done  # the env (max_turns 3) wanted a second turn
    assert s.result().finish_reason == "max_turns" and s.final_reward() == 1.0  # 1 of 1 turns says the word

    broken = {"env": "vf_word_env", "args": {"num_examples": 2, "broken_rubric": True}}
    agent = build_agent({"verifiers": broken, "reward": "env", "on_error_score": -1.0}, smollm2_tok, max_tokens=60)
    s = AgentSession(agent, row)
    s.end_turn(smollm2_tok.encode("apple", add_special_tokens=False), "length").result()
    traj = s.result()  # a rubric that fails is counted, and the trajectory scores on_error_score
    assert traj.error and traj.metrics["env_errors"] == 1.0 and s.final_reward() == -1.0


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
    s = AgentSession(agent, row)
    r = s.end_turn(turn(smollm2_tok, "<calc>124 * 76 * 74 * 24</calc>"), "stop").result()
    assert smollm2_tok.decode(r.observation_tokens) == "\n<|im_start|>user\n16737024<|im_end|>\n<|im_start|>assistant\n"
    last = s.end_turn(turn(smollm2_tok, "The answer is 16737024."), "stop").result()
    assert last.done and last.reward == 1.0  # a turn without <calc> ends the episode; the rubric checks the answer
    s = AgentSession(agent, row)
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


@pytest.mark.parametrize("installed", ["0.4.0", "0.1.10", "0.1.2"])
def test_a_verifiers_version_outside_the_supported_range_is_a_config_error(monkeypatch, installed):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed if name == "verifiers" else real(name))
    with pytest.raises(ConfigError, match=rf"verifiers {installed} is installed; this adapter supports "
                                          r"verifiers>=0\.1\.3,<0\.1\.4"):
        AgentSpec.from_config({"verifiers": WORD_ENV, "reward": "env"})
