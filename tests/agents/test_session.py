from __future__ import annotations

import copy
import json

import pytest

from torchrlhf.agents import AgentSession, AgentSpec, TokenMismatchError, build_agent
from torchrlhf.config import ConfigError

IM_END = 2  # SmolLM2's <|im_end|>: the token the model samples to end its turn

# A Qwen2.5-style ChatML template with a tool role and tools= (SmolLM2's own template has neither).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def turn(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [IM_END]


def full_render(tok, messages, tools=None) -> list[int]:
    """Independent reference: the whole conversation rendered from text and tokenized at once."""
    kwargs = {"tools": tools} if tools else {}
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def calc_agent(tok, max_tokens=200, **overrides):
    cfg = {"tools": ["calculator"], "tool_calls": {"format": "tags", "tags": {"calc": "calculator"}}, "isolate": False,
           "check_tokens": "metric", **overrides}
    return build_agent(cfg, tok, max_tokens=max_tokens)


QUESTION = [{"role": "user", "content": "What is 231 * 47?"}]


def test_delta_is_token_exact_for_smollm2_template(smollm2_tok):
    tok = smollm2_tok
    agent = calc_agent(tok)
    s = AgentSession(agent, {"prompt": QUESTION})
    assert s.prompt_tokens == full_render(tok, QUESTION)
    t1 = turn(tok, "<calc>231 * 47</calc>")
    r1 = s.end_turn(t1, "stop").result()
    convo = [*QUESTION, {"role": "assistant", "content": "<calc>231 * 47</calc>"}, {"role": "user", "content": "10857"}]
    assert s.prompt_tokens + t1 + r1.observation_tokens == full_render(tok, convo)
    assert tok.decode(r1.observation_tokens) == "\n<|im_start|>user\n10857<|im_end|>\n<|im_start|>assistant\n"
    t2 = turn(tok, "The answer is 10857.")
    assert s.end_turn(t2, "stop").result().done
    traj = s.result()
    assert traj.response_tokens == t1 + r1.observation_tokens + t2
    assert traj.loss_mask == [1] * len(t1) + [0] * len(r1.observation_tokens) + [1] * len(t2)
    assert traj.turn_spans == [(0, len(t1)), (len(t1) + len(r1.observation_tokens), len(traj.response_tokens))]
    assert traj.finish_reason == "stop" and traj.final_text == "The answer is 10857."
    assert traj.metrics["num_turns"] == 2 and traj.metrics["tool_calls"] == 1
    assert traj.metrics["observation_tokens"] == len(r1.observation_tokens)
    assert traj.token_check.mismatches == 0 and traj.metrics["token_mismatches"] == 0


def test_check_mode_finds_a_non_canonical_tokenization(smollm2_tok):
    tok = smollm2_tok
    # The model sampled "The answer" one character at a time: the same text, other tokens.
    chars = [tok.convert_tokens_to_ids(c) for c in "The"] + tok.encode(" answer is 5.", add_special_tokens=False)
    assert tok.decode(chars) == "The answer is 5." and chars != tok.encode("The answer is 5.", add_special_tokens=False)
    s = AgentSession(calc_agent(tok), {"prompt": QUESTION})
    s.end_turn(chars + [IM_END], "stop")
    check = s.result().token_check
    assert check.mismatches > 0 and check.first_mismatch == len(s.prompt_tokens)
    s = AgentSession(calc_agent(tok, check_tokens="error"), {"prompt": QUESTION})
    s.end_turn(chars + [IM_END], "stop")
    with pytest.raises(TokenMismatchError, match="differs"):
        s.result()


def test_tool_role_template_with_tools_and_parallel_hermes_calls(smollm2_tok, user_tools):
    tok = copy.deepcopy(smollm2_tok)
    tok.chat_template = TOOL_TEMPLATE
    agent = build_agent({"tools": ["calculator", "agent_user_tools:echo"], "check_tokens": "metric"}, tok,
                        max_tokens=200)
    assert agent.renderer.observation_role == "tool"
    schemas = [t.schema for t in agent.tools.values()]
    s = AgentSession(agent, {"prompt": QUESTION})
    assert s.prompt_tokens == full_render(tok, QUESTION, schemas) and '"calculator"' in tok.decode(s.prompt_tokens)
    text = ('<tool_call>{"name": "calculator", "arguments": {"expression": "231 * 47"}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>')
    t1 = turn(tok, text)
    future = s.end_turn(t1, "stop")
    assert s.turn_budget() == 0 or future.done()  # no new turn while the tools run
    r1 = future.result(timeout=120)
    convo = [*QUESTION, {"role": "assistant", "content": text},
             {"role": "tool", "content": "10857"}, {"role": "tool", "content": "hi"}]
    assert s.prompt_tokens + t1 + r1.observation_tokens == full_render(tok, convo, schemas)
    assert s.turn_budget() == 200 - len(t1)
    s.end_turn(turn(tok, "10857"), "stop").result()
    assert s.result().metrics["token_mismatches"] == 0 and s.result().metrics["tool_calls"] == 2
    agent.close()


def test_bad_tools_become_counted_error_observations(smollm2_tok, user_tools):
    tools = ["agent_user_tools:boom", "agent_user_tools:sleepy", "agent_user_tools:number", "agent_user_tools:echo"]
    with build_agent({"tools": tools, "timeout_s": 2.0, "num_workers": 2, "tool_calls": {"max_parallel": 5}}, smollm2_tok,
                     max_tokens=300) as agent:
        s = AgentSession(agent, {"prompt": QUESTION})
        calls = [{"name": "boom", "arguments": {"text": "x"}}, {"name": "sleepy", "arguments": {"seconds": 60}},
                 {"name": "number", "arguments": {"text": "x"}}, {"name": "nope", "arguments": {}},
                 {"name": "echo", "arguments": {"text": "still here"}}]
        text = "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls) + "<tool_call>{bad json</tool_call>"
        future = s.end_turn(turn(smollm2_tok, text), "stop")
        result = future.result(timeout=120)
        observation = smollm2_tok.decode(result.observation_tokens)
        assert "RuntimeError: tool exploded" in observation
        assert "timed out after 2s" in observation
        assert "returned int, not a string" in observation
        assert "unknown tool 'nope'" in observation
        assert "still here" in observation and "not valid JSON" in observation
        s.end_turn(turn(smollm2_tok, "done"), "stop").result()
        m = s.result().metrics
        assert (m["tool_calls"], m["tool_errors"], m["tool_timeouts"]) == (6, 4, 1)


def test_on_error_end_scores_the_trajectory(smollm2_tok):
    agent = build_agent({"tools": ["calculator"], "isolate": False, "on_error": "end", "on_error_score": -1.0},
                        smollm2_tok, max_tokens=100)
    s = AgentSession(agent, {"prompt": QUESTION})
    assert s.end_turn(turn(smollm2_tok, '<tool_call>{"name": "calc"}</tool_call>'), "stop").result().done
    traj = s.result()
    assert traj.error and traj.finish_reason == "error" and traj.metrics["tool_errors"] == 1
    assert s.final_reward(1.0) == -1.0


def test_environment_reset_step_done_and_per_trajectory_state(smollm2_tok, user_tools):
    agent = build_agent({"env": {"_component_": "agent_user_tools.Counter"}, "reward": "sum", "max_turns": 5},
                        smollm2_tok, max_tokens=100)
    a, b = AgentSession(agent, {"prompt": QUESTION}), AgentSession(agent, {"prompt": QUESTION})
    assert smollm2_tok.decode(a.prompt_tokens).endswith("<|im_start|>user\ncount with me<|im_end|>\n<|im_start|>assistant\n")
    r = a.end_turn(turn(smollm2_tok, "one"), "stop").result()
    assert smollm2_tok.decode(r.observation_tokens) == "\n<|im_start|>user\nturn 1<|im_end|>\n<|im_start|>assistant\n"
    assert r.reward == 0.5 and b.env.n == 0  # b's environment is its own
    assert not a.end_turn(turn(smollm2_tok, "two"), "stop").result().done
    last = a.end_turn(turn(smollm2_tok, "three"), "stop").result()
    assert last.done and last.reward == 0.5
    traj = a.result()
    assert traj.turn_rewards == [0.5, 0.5, 0.5] and traj.finish_reason == "env_done"
    assert a.final_reward(reward_fn_score=1.0) == 2.5 and a.turn_budget() == 0
    assert a.env.closed == 1 and b.env.closed == 0  # an ended trajectory frees its environment, once


def test_a_trajectory_cut_by_max_turns_closes_its_environment(smollm2_tok, user_tools):
    agent = build_agent({"env": {"_component_": "agent_user_tools.Counter"}, "reward": "env", "max_turns": 2},
                        smollm2_tok, max_tokens=100)
    s = AgentSession(agent, {"prompt": QUESTION})
    assert not s.end_turn(turn(smollm2_tok, "one"), "stop").result().done and s.env.closed == 0
    assert s.end_turn(turn(smollm2_tok, "two"), "stop").result().done
    assert s.result().finish_reason == "max_turns" and s.env.closed == 1


def test_environment_failures(smollm2_tok, user_tools):
    bad_reset = AgentSession(build_agent({"env": {"_component_": "agent_user_tools.BadReset"}, "reward": "env",
                                          "on_error_score": -2.0}, smollm2_tok, max_tokens=50), {"prompt": QUESTION})
    assert bad_reset.turn_budget() == 0
    traj = bad_reset.result()
    assert traj.error and traj.response_tokens == [] and traj.metrics["env_errors"] == 1
    assert bad_reset.final_reward() == -2.0
    agent = build_agent({"env": {"_component_": "agent_user_tools.BadStep"}, "reward": "env", "max_turns": 2},
                        smollm2_tok, max_tokens=50)
    s = AgentSession(agent, {"prompt": QUESTION})
    r = s.end_turn(turn(smollm2_tok, "hi"), "stop").result()
    assert "Error: the environment failed: KeyError" in smollm2_tok.decode(r.observation_tokens)
    assert s.end_turn(turn(smollm2_tok, "hi"), "stop").result().done
    assert s.result().metrics["env_errors"] == 2 and s.result().finish_reason == "max_turns"


def test_bad_config_fails_before_anything_runs(user_tools):
    with pytest.raises(ConfigError, match="not an environment"):
        AgentSpec.from_config({"env": {"_component_": "agent_user_tools.NotAnEnv"}, "reward": "env"})
    with pytest.raises(ConfigError, match="rollout.agent.tools"):
        AgentSpec.from_config({"tools": ["agent_user_tools:missing"]})
    with pytest.raises(ConfigError, match="unknown key 'max_turn'"):
        AgentSpec.from_config({"tools": ["calculator"], "max_turn": 3})
    with pytest.raises(ConfigError, match="rollout.agent.tags: moved to rollout.agent.tool_calls.tags"):
        AgentSpec.from_config({"tools": ["calculator"], "tags": {"calc": "calculator"}})
    with pytest.raises(ConfigError, match="rollout.agent.tool_calls.max_parallel: must be >= 1, got 0"):
        AgentSpec.from_config({"tools": ["calculator"], "tool_calls": {"max_parallel": 0}})
    with pytest.raises(ConfigError, match="rollout.agent.observation.role: must be 'auto', 'tool' or 'user'"):
        AgentSpec.from_config({"tools": ["calculator"], "observation": {"role": "assistant"}})
    with pytest.raises(ConfigError, match="needs an env"):
        AgentSpec.from_config({"tools": ["calculator"], "reward": "env"})
    with pytest.raises(ConfigError, match="unexpected keyword"):
        AgentSpec.from_config({"env": {"_component_": "agent_user_tools.Counter", "stop": 3}, "reward": "env"})


def test_config_from_yaml(smollm2_tok, user_tools):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create("tools: [calculator]\ntool_calls: {format: tags, tags: {calc: calculator}}\ncheck_tokens: off\n"
                           "env: {_component_: agent_user_tools.Counter, start: 2}\nreward: sum\nmax_turns: 3\n")
    spec = AgentSpec.from_config(cfg)
    assert spec.check_tokens == "off" and spec.tools == ("calculator",) and spec.env["start"] == 2
    agent = build_agent(cfg, smollm2_tok, max_tokens=64)
    s = AgentSession(agent, {"prompt": QUESTION})
    r = s.end_turn(turn(smollm2_tok, "<calc>6 * 7</calc>"), "stop").result()  # a tool turn: the env is not stepped
    assert "42" in smollm2_tok.decode(r.observation_tokens) and s.env.n == 0
    r = s.end_turn(turn(smollm2_tok, "The answer is 42."), "stop").result()  # no call: the env's action
    assert s.env.n == 1 and r.reward == 0.5 and not r.done


def test_env_reset_failure_without_a_prompt_still_ends_cleanly(smollm2_tok, user_tools):
    agent = build_agent({"env": {"_component_": "agent_user_tools.BadReset"}, "reward": "env"}, smollm2_tok,
                        max_tokens=8)
    s = AgentSession(agent, {"ground_truth": "1"})
    assert s.turn_budget() == 0 and s.result().error and s.result().metrics["env_errors"] == 1


def test_max_turns_budgets_and_length(smollm2_tok):
    tok = smollm2_tok
    call = turn(tok, "<calc>1 + 1</calc>")
    s = AgentSession(calc_agent(tok, max_turns=2), {"prompt": QUESTION})
    r = s.end_turn(call, "stop").result()
    assert s.turn_budget() == 200 - len(call)
    assert s.end_turn(call, "stop").result().done  # a call on the last allowed turn is not run
    assert s.result().finish_reason == "max_turns" and s.result().metrics["tool_calls"] == 1
    assert s.result().response_tokens == call + r.observation_tokens + call

    s = AgentSession(calc_agent(tok), {"prompt": QUESTION, "max_tokens": len(call) + 3})  # the row's own budget
    s.end_turn(call, "stop").result()
    assert s.turn_budget() == 3  # model tokens count over all turns; observation tokens do not
    s.end_turn([5, 6, 7], "length").result()
    assert s.result().finish_reason == "length"
    with pytest.raises(RuntimeError, match="done"):
        s.end_turn([5], "stop")

    prompt = AgentSession(calc_agent(tok), {"prompt": QUESTION}).prompt_tokens
    cap = len(prompt) + len(call) + 5  # room for the call, not for the observation (15 tokens) + 1
    s = AgentSession(build_agent({"tools": ["calculator"], "tool_calls": {"format": "tags", "tags": {"calc": "calculator"}},
                                  "isolate": False}, tok, max_tokens=200, max_trajectory_tokens=cap), {"prompt": QUESTION})
    assert s.turn_budget() == len(call) + 5
    with pytest.raises(ValueError, match="a turn has 1 to turn_budget"):
        s.end_turn(list(range(len(call) + 6)), "stop")
    assert s.end_turn(call, "stop").result().done
    assert s.result().finish_reason == "budget" and s.result().response_tokens == call


def test_long_observation_is_truncated_with_a_marker(smollm2_tok, user_tools):
    tok = smollm2_tok
    agent = build_agent({"tools": ["agent_user_tools:echo"], "tool_calls": {"format": "tags"}, "isolate": False,
                         "max_tool_response_tokens": 12, "check_tokens": "metric"}, tok, max_tokens=300)
    s = AgentSession(agent, {"prompt": QUESTION})
    long = " ".join(str(i) for i in range(100))
    r = s.end_turn(turn(tok, f"<echo>{long}</echo>"), "stop").result()
    obs = tok.decode(r.observation_tokens)
    content = obs.split("user\n", 1)[1].split("<|im_end|>")[0]
    assert content.endswith(" ...[truncated]") and content.startswith("0 1 2")
    assert len(tok.encode(content, add_special_tokens=False)) <= 12
    s.end_turn(turn(tok, "ok"), "stop").result()
    assert s.result().metrics["truncated_observations"] == 1 and s.result().metrics["token_mismatches"] == 0


def test_guess_number_binary_search(smollm2_tok):
    agent = build_agent({"env": {"_component_": "torchrlhf.agents.builtin.GuessNumber", "low": 1, "high": 100},
                         "reward": "env", "max_turns": 8}, smollm2_tok, max_tokens=200)
    s = AgentSession(agent, {"ground_truth": "37"})
    low, high, hints = 1, 100, []
    while s.turn_budget():
        guess = (low + high) // 2
        r = s.end_turn(turn(smollm2_tok, f"My guess is {guess}."), "stop").result()
        if r.done:
            break
        hint = smollm2_tok.decode(r.observation_tokens)
        hints.append(hint.split("user\n")[1].split("<|im_end|>")[0])
        low, high = (guess + 1, high) if hints[-1] == "Higher." else (low, guess - 1)
    assert hints == ["Lower.", "Higher."]  # guesses 50, 25, then 37
    traj = s.result()
    assert traj.turn_rewards == [0.0, 0.0, 1.0] and s.env.guesses == 3
    assert traj.turn_rewards[-1] == 1.0 and s.final_reward() == 1.0 and traj.finish_reason == "env_done"
