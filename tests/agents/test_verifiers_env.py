"""verifiers 0.4 environments (`torchrlhf.agents.verifiers_env`): each trajectory is one episode of the env, whose
policy seat calls the harness endpoint. `vf_word_env` is a module written the way verifiers' scaffold gives one.

The endpoint's turns are scripted here (``scripted``: the model's text per row and turn, through the runner's agent
sessions as an engine drives them), so the rewards are known exactly. Needs ``verifiers`` 0.4 (those tests skip
without it); the version check runs without it.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from torchrlhf.agents import AgentSpec, build_agent
from torchrlhf.agents.session import agent_columns
from torchrlhf.config import ConfigError
from torchrlhf.generation.session import run_rounds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
WORD_ENV = {"env": "vf_word_env", "args": {"num_examples": 2}}
AGAIN = "<|im_start|>user\nSay it again.<|im_end|>\n<|im_start|>assistant\n"


def _has_verifiers_v1() -> bool:
    try:
        return importlib.util.find_spec("verifiers.v1") is not None
    except ModuleNotFoundError:
        return False


needs_verifiers = pytest.mark.skipif(not _has_verifiers_v1(), reason="needs verifiers 0.4 (pip install 'torchrlhf[verifiers]')")


@pytest.fixture
def word_env_path(monkeypatch):
    """vf_word_env importable here and in the tool server verifiers starts as ``python -m vf_word_env``."""
    monkeypatch.syspath_prepend(HERE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))


def rows_of(node: dict, tmp_path, split: str = "train") -> list[dict]:
    from torchrlhf.agents.verifiers_env import verifiers_data_files

    train, val = verifiers_data_files(node, str(tmp_path), [])
    return [json.loads(line) for line in open((train if split == "train" else val)[0])]


def scripted(tok, turns):
    """A driver of the runner's sessions whose model says ``turns(row, k)`` at turn k (text, or token ids), cut to
    the turn's budget."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def drive(sessions, seeds):
        def sample(live, _round):
            out = []
            for k in live:
                s = sessions[k]
                said = turns(s.session.row, sum(1 for c in s.session.calls if c.completion))
                tokens = (said if isinstance(said, list) else tok.encode(said, add_special_tokens=False)) + [im_end]
                budget = s.turn_budget()
                out.append((tokens[:budget], [0.0] * min(budget, len(tokens)),
                            "stop" if len(tokens) <= budget else "length"))
            return out

        return run_rounds(sessions, sample)

    return drive


def run(tok, node: dict, rows: list[dict], turns, max_tokens: int = 60, **spec):
    """The runner's trajectories of ``rows``, each an episode of ``node`` with the scripted model."""
    from torchrlhf.agents.harness import HarnessRunner

    agent = build_agent({"verifiers": node, "reward": "env", **spec}, tok, max_tokens=max_tokens)
    runner = HarnessRunner(agent, agent.harness)
    try:
        return runner.run(rows, list(range(len(rows))), scripted(tok, turns))[0]
    finally:
        runner.close()


def text(tok, traj) -> str:
    return tok.decode(traj.response_tokens)


@needs_verifiers
def test_tasks_become_prompt_files(tmp_path, word_env_path):
    from torchrlhf.agents.verifiers_env import verifiers_data_files

    node = {**WORD_ENV, "val_args": {"split": "eval"}}
    train, val = verifiers_data_files(node, str(tmp_path), [])
    rows = [json.loads(line) for line in open(train[0])]
    assert rows[1]["prompt"] == [{"role": "system", "content": "You repeat words."},
                                 {"role": "user", "content": "Say the word 'river'."}]
    assert {k: rows[1][k] for k in ("ground_truth", "data_source", "verifiers_split", "verifiers_idx")} == \
        {"ground_truth": "river", "data_source": "vf_word_env", "verifiers_split": "train", "verifiers_idx": 1}
    assert len(rows) == 2 and len(rows[1]["verifiers_key"]) == 64  # the task's content hash
    assert [json.loads(line)["ground_truth"] for line in open(val[0])] == ["pearl", "ocean"]  # val_args: split eval
    assert verifiers_data_files(node, str(tmp_path), ["mine.jsonl"])[1] == ["mine.jsonl"]  # given files win
    assert verifiers_data_files(WORD_ENV, str(tmp_path), [])[1] == []  # no val_args: no validation rows


@needs_verifiers
def test_the_env_drives_the_turns_and_its_reward_scores(smollm2_tok, tmp_path, word_env_path):
    """The env's second message is the observation (the chat template's delta after the model's turn, not trained
    on); the reward is the fraction of model turns that say the word; the trajectory is token-exact."""
    rows = rows_of(WORD_ENV, tmp_path)
    said = {0: ["apple", "pear"], 1: ["river", "river!"]}
    trajs = run(smollm2_tok, WORD_ENV, rows, lambda row, k: said[row["verifiers_idx"]][k], check_tokens="error")
    assert [text(smollm2_tok, t) for t in trajs] == [f"apple<|im_end|>\n{AGAIN}pear<|im_end|>",
                                                     f"river<|im_end|>\n{AGAIN}river!<|im_end|>"]
    first = trajs[0]
    observation = [tok for tok, m in zip(first.response_tokens, first.loss_mask, strict=True) if not m]
    assert smollm2_tok.decode(observation) == f"\n{AGAIN}"  # the env's message, masked out of the loss
    assert [t.env_reward for t in trajs] == [0.5, 1.0] and [t.finish_reason for t in trajs] == ["stop", "stop"]
    assert all(t.metrics == {"num_turns": 2.0, "harness_splits": 0.0, "token_mismatches": 0.0} for t in trajs)


@needs_verifiers
def test_check_tokens_counts_a_turn_a_re_render_would_tokenize_otherwise(smollm2_tok, tmp_path, word_env_path):
    """"apple" sampled letter by letter: the trajectory keeps the sampled tokens, and re-rendering its text gives
    the tokenizer's own encoding, 1 token where the model sampled 5 (the positions from there on differ)."""
    rows = rows_of(WORD_ENV, tmp_path)[:1]
    letters = [smollm2_tok.convert_tokens_to_ids(c) for c in "apple"]

    def turns(row, k):
        return letters if k == 0 else "apple"

    traj, = run(smollm2_tok, WORD_ENV, rows, turns, check_tokens="metric")
    assert traj.response_tokens[:5] == letters and traj.env_reward == 1.0
    assert traj.metrics["token_mismatches"] >= 4
    with pytest.raises(Exception, match="re-rendering the conversation from text differs"):
        run(smollm2_tok, WORD_ENV, rows, turns, check_tokens="error")


@needs_verifiers
def test_rows_sharing_a_prompt_keep_their_own_task(smollm2_tok, tmp_path, word_env_path):
    """A game whose secret is only in the answer: every row has one prompt text. Each trajectory plays and is scored
    with its own row's task (found by its split and idx), the validation rows with theirs."""
    node = {"env": "vf_word_env", "args": {"num_examples": 3, "secret": True}, "val_args": {"split": "eval"}}
    for split, words in (("train", ["apple", "river", "stone"]), ("val", ["pearl", "ocean", "maple"])):
        rows = rows_of(node, tmp_path, split)
        assert len({json.dumps(row["prompt"]) for row in rows}) == 1  # the prompt text tells no row apart
        trajs = run(smollm2_tok, node, rows, lambda row, k: row["ground_truth"])
        assert [t.env_reward for t in trajs] == [1.0, 1.0, 1.0]
        assert [row["ground_truth"] for row in rows] == words
        trajs = run(smollm2_tok, node, rows, lambda row, k, words=words: words[(row["verifiers_idx"] + 1) % 3])
        assert [t.env_reward for t in trajs] == [0.0, 0.0, 0.0]


@needs_verifiers
def test_an_episode_our_token_budget_ends_is_scored(smollm2_tok, tmp_path, word_env_path):
    """rollout.max_tokens is the seat's max_output_tokens: a turn cut by it ends the episode (verifiers refuses the
    next turn) and the reward scores it as it stands, the cut turn included; so does a budget spent exactly."""
    rows = rows_of(WORD_ENV, tmp_path)[:1]
    cut, = run(smollm2_tok, WORD_ENV, rows, lambda row, k: "apple, apple and more", max_tokens=3)
    assert text(smollm2_tok, cut) == "apple, apple" and cut.finish_reason == "length"
    assert cut.env_reward == 1.0 and not cut.error and cut.metrics["num_turns"] == 1.0  # 1 of 1 turns says it
    spent = len(smollm2_tok.encode("pear", add_special_tokens=False)) + 1
    exact, = run(smollm2_tok, WORD_ENV, rows, lambda row, k: "pear", max_tokens=spent)
    assert text(smollm2_tok, exact) == "pear<|im_end|>" and exact.finish_reason == "stop"
    assert exact.env_reward == 0.0 and not exact.error and exact.metrics["num_turns"] == 1.0


@needs_verifiers
def test_a_reward_that_raises_is_a_counted_error(smollm2_tok, tmp_path, word_env_path):
    """verifiers marks the trace failed (not ok, its rewards unset): an error sample, never a silent 0."""
    node = {"env": "vf_word_env", "args": {"num_examples": 2, "task": {"broken": True}}}
    trajs = run(smollm2_tok, node, rows_of(node, tmp_path), lambda row, k: row["ground_truth"])
    assert all(t.error and t.finish_reason == "error" for t in trajs)
    assert agent_columns(trajs)["agent_error"].tolist() == [1.0, 1.0]  # scored on_error_score by the pipeline


@needs_verifiers
def test_tool_calls_run_on_the_tasks_toolset(smollm2_tok, tmp_path, word_env_path):
    """A Hermes <tool_call> is an OpenAI tool call to the seat's harness, which runs it on the task's MCP toolset
    (named <prefix>_<tool>); its result is the next observation. An unknown tool's error is one too."""
    node = {"env": "vf_word_env", "args": {"num_examples": 1, "task": {"tools": True}}}
    said = ['<tool_call>{"name": "word_add", "arguments": {"a": 2, "b": 3}}</tool_call>',
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>', "apple", "apple"]
    traj, = run(smollm2_tok, node, rows_of(node, tmp_path), lambda row, k: said[k], max_tokens=200,
                check_tokens="error")
    whole = text(smollm2_tok, traj)
    assert f"{said[0]}<|im_end|>\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n{said[1]}" in whole
    assert "<|im_start|>tool\nerror: unknown tool 'mul'" in whole and whole.endswith(f"{AGAIN}apple<|im_end|>")
    assert traj.env_reward == 0.5 and traj.metrics["num_turns"] == 4.0  # 2 of the 4 model turns say the word
    assert traj.metrics["token_mismatches"] == 0.0 and traj.metrics["harness_splits"] == 0.0


@needs_verifiers
def test_a_module_file_runs_the_calculator_recipe_env(smollm2_tok, tmp_path):
    """``env: path/to/module.py`` loads a module that is not installed: here the demo's recipes/envs/vf_calculator.py."""
    node = {"env": os.path.join(REPO, "recipes", "envs", "vf_calculator.py"), "args": {"num_tasks": 2},
            "val_args": {"split": "test"}}
    row = rows_of(node, tmp_path)[0]
    assert row["prompt"][-1] == {"role": "user", "content": "What is 124 * 76 * 74 * 24?"}  # after the few-shot exchange
    assert row["prompt"][1] == {"role": "assistant", "content": "<calc>231 * 47</calc>"}
    assert row["ground_truth"] == "16737024" and row["data_source"] == "vf_calculator"  # the file's stem names it
    right = ["<calc>124 * 76 * 74 * 24</calc>", "The answer is 16737024."]
    traj, = run(smollm2_tok, node, [row], lambda row, k: right[k], check_tokens="error")
    assert text(smollm2_tok, traj) == (f"{right[0]}<|im_end|>\n<|im_start|>user\n16737024<|im_end|>\n"
                                       f"<|im_start|>assistant\n{right[1]}<|im_end|>")
    assert traj.env_reward == 1.0
    wrong, = run(smollm2_tok, node, [row], lambda row, k: "The answer is 16737.")
    assert wrong.env_reward == 0.0 and wrong.metrics["num_turns"] == 1.0  # no <calc>: the env ends the episode


@needs_verifiers
@pytest.mark.parametrize("cfg,match", [
    ({"verifiers": {"env": "no_such_vf_env"}, "reward": "env"}, "taskset 'no_such_vf_env' not found"),
    ({"verifiers": {"env": "envs/missing_env.py"}, "reward": "env"}, "file not found: envs/missing_env.py"),
    ({"verifiers": {"env": "pkg.vf_env"}, "reward": "env"}, "imports a taskset by its top-level module name"),
    ({"verifiers": WORD_ENV}, "trace.reward scores the trajectory; set reward: env"),
    ({"verifiers": WORD_ENV, "env": {"_component_": "x.Y"}, "reward": "env"}, "set env or verifiers, not both"),
    ({"verifiers": {"name": "vf_word_env"}, "reward": "env"}, "verifiers must be {env: NAME, args:"),
    ({"verifiers": WORD_ENV, "reward": "env", "max_turns": 3}, "max_turns do not apply to a verifiers environment"),
    ({"verifiers": {"env": "vf_word_env", "args": {"num_exampels": 2}}, "reward": "env"}, "(?s)args: .*num_exampels"),
    ({"verifiers": {"env": "vf_word_env", "val_args": {"split": "test"}}, "reward": "env"}, "(?s)val_args: .*split"),
])
def test_config_errors(cfg, match, word_env_path):
    with pytest.raises(ConfigError, match=match):
        AgentSpec.from_config(cfg)


@pytest.mark.parametrize("installed", ["0.1.3", "0.3.9", "0.5.0"])
def test_a_verifiers_version_outside_the_supported_range_is_a_config_error(monkeypatch, installed):
    """Runs with any verifiers installed, or none: the installed version is what `importlib.metadata` says."""
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed if name == "verifiers" else real(name))
    with pytest.raises(ConfigError, match=rf"verifiers {installed} is installed; this adapter supports "
                                          r"verifiers>=0\.4,<0\.5 \(its verifiers\.v1 API\)"):
        AgentSpec.from_config({"verifiers": WORD_ENV, "reward": "env"})
