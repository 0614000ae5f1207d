"""Environments of both shapes: step environments and TRL-style tool environments (`reset(**row)`, public
methods as tools, optional `get_reward`), with every kind of bad behaviour.

The tool environment is written the way TRL's ``environment_factory`` docs show one (a counter the model
increments through a method tool), and named by file path (``/path/file.py:Class``), as a user would.
"""

from __future__ import annotations

import json
import textwrap
import threading

import pytest

from torchrlhf.agents import AgentSession, AgentSpec, build_agent
from torchrlhf.agents.env import call_with_timeout
from torchrlhf.config import ConfigError
from torchrlhf.utils.isolated import CallTimeout

IM_END = 2  # SmolLM2's <|im_end|>
QUESTION = [{"role": "user", "content": "Add 2, then 3."}]

ENVS = textwrap.dedent(
    '''
    import time


    def act(x: int) -> str:
        """A plain tool named like NoReward's method.

        Args:
            x: ignored.
        """
        return "ok"


    class CounterEnv:
        """TRL's shape: reset(**kwargs), a method tool with an Args: docstring, get_reward."""

        def __init__(self, target: int = 5):
            self.target = target
            self.total = 0
            self.row = None

        def reset(self, **kwargs) -> str | None:
            self.total = 0
            self.row = kwargs
            return None

        def increment(self, a: int) -> int:
            """Add to the running total.

            Args:
                a: how much to add.

            Returns:
                The new total.
            """
            self.total += a
            return self.total

        def get_reward(self) -> float:
            return 1.0 if self.total == self.target else 0.0


    class BadToolEnv:
        def reset(self, **kwargs):
            return "go"

        def explode(self, x: int) -> str:
            """Fails.

            Args:
                x: ignored.
            """
            raise RuntimeError("env tool exploded")

        def hang(self, x: int) -> str:
            """Takes far longer than its time limit (the abandoned daemon thread ends with the tests).

            Args:
                x: ignored.
            """
            time.sleep(120)
            return "late"

        def weird(self, x: int) -> str:
            """Returns an object, not text.

            Args:
                x: ignored.
            """
            return object()

        def get_reward(self) -> float:
            return "high"


    class RaisingReset:
        def reset(self, **kwargs):
            raise ValueError("no episode today")

        def act(self, x: int) -> str:
            """Acts.

            Args:
                x: ignored.
            """
            return "ok"


    class WrongResetType:
        def reset(self, **kwargs):
            return 42

        def act(self, x: int) -> str:
            """Acts.

            Args:
                x: ignored.
            """
            return "ok"


    class HangingStep:
        def reset(self, row):
            return None

        def step(self, text):
            time.sleep(120)
            return None, 0.0, True


    class WrongStepType:
        def reset(self, row):
            return None

        def step(self, text):
            return "fine", "1.0", False


    class NoStep:
        def reset(self, row):
            return None


    class NoTools:
        def reset(self, **kwargs):
            return None


    class Undocumented:
        def reset(self, **kwargs):
            return None

        def act(self, x: int) -> str:
            return "ok"


    class NoReward:
        def reset(self, **kwargs):
            return None

        def act(self, x: int) -> str:
            """Acts.

            Args:
                x: ignored.
            """
            return "ok"
    '''
)


@pytest.fixture
def envs(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(ENVS)
    return str(path)


def turn(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [IM_END]


def call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def agent_for(tok, envs, cls, **overrides):
    return build_agent({"env": {"_component_": f"{envs}:{cls}"}, "isolate": False, **overrides}, tok, max_tokens=200)


def test_trl_shaped_env_methods_are_tools_and_get_reward_scores(smollm2_tok, envs):
    tok = smollm2_tok
    agent = agent_for(tok, envs, "CounterEnv", reward="env", check_tokens="metric", max_turns=4)
    assert set(agent.tools) == {"increment"}  # reset and get_reward are not tools
    assert agent.tools["increment"].schema["function"]["parameters"]["properties"] == {
        "a": {"type": "integer", "description": "how much to add."}}
    row = {"prompt": QUESTION, "ground_truth": [2, 3], "extra_info": {"id": 7}}
    a, b = AgentSession(agent, row, QUESTION), AgentSession(agent, row, QUESTION)
    assert a.env.row == row and a.env.row["ground_truth"] == [2, 3]  # reset(**row): the row itself
    r1 = a.end_turn(turn(tok, call("increment", a=2)), "stop").result()
    assert "\n2<|im_end|>" in tok.decode(r1.observation_tokens)  # an int result becomes its text
    r2 = a.end_turn(turn(tok, call("increment", a=3)), "stop").result()
    assert "\n5<|im_end|>" in tok.decode(r2.observation_tokens) and b.env.total == 0  # per-trajectory state
    assert a.end_turn(turn(tok, "The total is 5."), "stop").result().done  # no call: the final answer
    traj = a.result()
    assert traj.finish_reason == "stop" and traj.final_text == "The total is 5."
    assert traj.turn_rewards == [0.0, 0.0, 1.0] and a.final_reward() == 1.0  # get_reward once, at the end
    assert traj.metrics["tool_calls"] == 2 and traj.metrics["token_mismatches"] == 0
    b.end_turn(turn(tok, call("increment", a=4)), "stop").result()
    b.end_turn(turn(tok, "4"), "stop").result()
    assert b.final_reward() == 0.0


def test_a_turns_method_calls_run_in_order_on_one_env(smollm2_tok, envs):
    tok = smollm2_tok
    s = AgentSession(agent_for(tok, envs, "CounterEnv"), {"prompt": QUESTION}, QUESTION)
    calls = "".join(call("increment", a=a) for a in (2, 3, 4))
    r = s.end_turn(turn(tok, calls), "stop").result()
    assert tok.decode(r.observation_tokens) == "\n<|im_start|>user\n2\n5\n9<|im_end|>\n<|im_start|>assistant\n"


def test_trl_env_bad_methods(smollm2_tok, envs):
    tok = smollm2_tok
    agent = agent_for(tok, envs, "BadToolEnv", timeout_s=0.5, max_turns=4)
    s = AgentSession(agent, {"prompt": QUESTION}, QUESTION)
    r = s.end_turn(turn(tok, call("explode", x=1)), "stop").result()
    assert "Error: tool 'explode' failed: RuntimeError: env tool exploded" in tok.decode(r.observation_tokens)
    r = s.end_turn(turn(tok, call("weird", x=1)), "stop").result()
    assert "returned object; a tool returns a string" in tok.decode(r.observation_tokens)
    r = s.end_turn(turn(tok, "done"), "stop").result()
    traj = s.result()  # get_reward returned a string: counted, and the trajectory scores on_error_score
    assert r.done and traj.error and traj.metrics["tool_errors"] == 2 and traj.metrics["env_errors"] == 1

    hung = AgentSession(agent, {"prompt": QUESTION}, QUESTION)  # on_error: observe, yet a hung env ends it
    assert hung.end_turn(turn(tok, call("hang", x=1)), "stop").result().done
    traj = hung.result()
    assert traj.error and traj.finish_reason == "error" and traj.metrics["tool_timeouts"] == 1


@pytest.mark.parametrize("cls,message", [("RaisingReset", "no episode today"), ("WrongResetType", "reset must return")])
def test_a_failed_reset_ends_the_trajectory_before_any_turn(smollm2_tok, envs, cls, message, caplog):
    """The documented choice: with on_error: observe too, a failed reset ends its trajectory (there is no
    environment state to continue from), scores on_error_score, counted in env_errors and agent_error."""
    import torchrlhf.agents.session as session

    session._failures_logged["n"] = 0
    agent = agent_for(smollm2_tok, envs, cls, on_error="observe", on_error_score=-1.0)
    s = AgentSession(agent, {"prompt": QUESTION}, QUESTION)
    assert s.turn_budget() == 0
    traj = s.result()
    assert traj.error and traj.response_tokens == [] and traj.metrics["env_errors"] == 1
    assert s.final_reward(reward_fn_score=1.0) == -1.0 and message in caplog.text


def test_step_env_hang_and_wrong_type(smollm2_tok, envs):
    tok = smollm2_tok
    agent = agent_for(tok, envs, "HangingStep", reward="env", timeout_s=0.5)
    s = AgentSession(agent, {"prompt": QUESTION}, QUESTION)
    assert s.end_turn(turn(tok, "hi"), "stop").result().done
    assert s.result().error and s.result().metrics["env_errors"] == 1
    agent = agent_for(tok, envs, "WrongStepType", reward="env", max_turns=2)
    s = AgentSession(agent, {"prompt": QUESTION}, QUESTION)
    r = s.end_turn(turn(tok, "hi"), "stop").result()
    assert not r.done and "step's reward must be a finite number" in tok.decode(r.observation_tokens)
    assert s.end_turn(turn(tok, "hi"), "stop").result().done  # max_turns
    assert s.result().metrics["env_errors"] == 2 and not s.result().error


def test_per_row_max_tokens_bounds_the_trajectory(smollm2_tok, envs):
    agent = agent_for(smollm2_tok, envs, "CounterEnv")
    s = AgentSession(agent, {"prompt": QUESTION, "max_tokens": 7}, QUESTION)
    assert s.turn_budget() == 7


def test_bad_env_classes_fail_at_config_time(envs):
    def spec(cls, **kw):
        return AgentSpec.from_config({"env": {"_component_": f"{envs}:{cls}"}, **kw})

    with pytest.raises(ConfigError, match="needs step"):
        spec("NoStep", reward="env")
    with pytest.raises(ConfigError, match="no public method"):
        spec("NoTools")
    with pytest.raises(ConfigError, match="Args:"):
        spec("Undocumented")
    with pytest.raises(ConfigError, match="has no get_reward"):
        spec("NoReward", reward="env")
    with pytest.raises(ConfigError, match="share the names"):
        AgentSpec.from_config({"env": {"_component_": f"{envs}:NoReward"}, "tools": [f"{envs}:act"]})
    assert spec("NoReward").env["_component_"].endswith(":NoReward")  # reward_fn needs no get_reward


def test_call_with_timeout_tells_a_hang_from_the_functions_own_timeout_error():
    """A call past its limit raises `CallTimeout`; a TimeoutError the function raises itself (a socket's) comes
    through as it is, not as a hang of the call."""
    gate = threading.Event()
    with pytest.raises(CallTimeout, match="wait ran past 0.2s"):
        call_with_timeout(gate.wait, 0.2)  # waits until the gate opens: a hang
    gate.set()

    def own_timeout() -> None:
        raise TimeoutError("the socket timed out")

    with pytest.raises(TimeoutError, match="the socket timed out") as raised:
        call_with_timeout(own_timeout, 300)
    assert not isinstance(raised.value, CallTimeout)
    assert call_with_timeout(lambda x: x + 1, 300, 1) == 2
