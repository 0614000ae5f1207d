"""`torchrlhf.agents.OpenEnv` against openenv-core's own server (an echo environment on loopback) and against fake
servers that misbehave. Needs ``openenv-core`` (skips without it)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("openenv.core.env_server")

from openenv_server import echo_server, free_port  # noqa: E402
from websockets.sync.server import serve  # noqa: E402

from torchrlhf.agents import AgentSession, OpenEnv, build_agent  # noqa: E402
from torchrlhf.config import ConfigError  # noqa: E402

IM_END = 2


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    with echo_server() as (url, _):
        yield url


def test_episode_observations_rewards_done(echo_url):
    env = OpenEnv(echo_url, observation_key="echoed_message", timeout_s=30)
    assert env.reset({}) == "Say something; I will repeat it."
    assert env.step("hello") == ("hello", 0.5, False)  # the echo env's reward: 0.1 a character
    assert env.step("hi") == ("hi", 0.2, True)  # done after two steps; the session is closed
    with pytest.raises(RuntimeError, match="step before reset"):
        env.step("again")
    whole = OpenEnv(echo_url, timeout_s=30)  # no observation_key: every field, as JSON
    assert json.loads(whole.reset({})) == {"echoed_message": "Say something; I will repeat it."}
    whole.close()


def test_server_errors_timeouts_and_bad_fields_raise(echo_url):
    env = OpenEnv(echo_url, observation_key="echoed_message", timeout_s=30)
    env.reset({})
    with pytest.raises(RuntimeError, match="the server failed the step: echo env crashed"):
        env.step("crash")
    env = OpenEnv(echo_url, observation_key="echoed_message", timeout_s=0.5)
    env.reset({})
    with pytest.raises(TimeoutError, match="no reply to step within 0.5s"):
        env.step("sleep")  # the echo env sleeps 5 s on it
    with pytest.raises(ValueError, match="no field 'text' .*observation_key.*echoed_message"):
        OpenEnv(echo_url, observation_key="text", timeout_s=30).reset({})


@pytest.fixture
def fake_server() -> Iterator[Callable[[Callable[[str, int], str | None]], str]]:
    """A WebSocket server on loopback whose replies come from ``answer(message, n)`` (None: drop the connection)."""
    servers = []

    def start(answer: Callable[[str, int], str | None]) -> str:
        def handler(ws):
            for n, message in enumerate(ws):
                reply = answer(message, n)
                if reply is None:
                    return  # the connection closes: a server that died
                ws.send(reply)

        def health(connection, request):  # what `OpenEnv.check` asks before training
            return connection.respond(200, "ok\n") if request.path == "/health" else None

        server = serve(handler, "127.0.0.1", 0, process_request=health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.socket.getsockname()[1]}"

    yield start
    for server in servers:
        server.shutdown()


OK_RESET = json.dumps({"type": "observation", "data": {"observation": {"text": "go"}, "reward": None, "done": False}})


def test_malformed_replies_and_a_server_that_dies(fake_server):
    cases = {
        "not JSON": "<html>502</html>",
        "not an observation": json.dumps({"type": "observation", "data": {"obs": 1}}),
        "reward must be a number": json.dumps({"type": "observation",
                                               "data": {"observation": {"text": "x"}, "reward": "high"}}),
    }
    for match, bad in cases.items():
        url = fake_server(lambda message, n, bad=bad: OK_RESET if n == 0 else bad)
        env = OpenEnv(url, observation_key="text", timeout_s=10)
        assert env.reset({}) == "go"
        with pytest.raises(ValueError, match=match):
            env.step("hello")
    url = fake_server(lambda message, n: OK_RESET if n == 0 else None)
    env = OpenEnv(url, observation_key="text", timeout_s=10)
    env.reset({})
    with pytest.raises(ConnectionError, match="the session broke during step"):
        env.step("hello")


def test_errors_become_counted_observations_in_a_session(fake_server, smollm2_tok):
    """A server that dies mid-run: each failed step is an error observation, counted in agent/env_errors."""
    url = fake_server(lambda message, n: OK_RESET if n == 0 else None)
    env = {"_component_": "torchrlhf.agents.OpenEnv", "base_url": url, "observation_key": "text", "timeout_s": 10}
    agent = build_agent({"env": env, "reward": "env", "max_turns": 2}, smollm2_tok, max_tokens=50)
    s = AgentSession(agent, {"prompt": "Talk to the server."})
    assert smollm2_tok.decode(s.prompt_tokens).endswith("<|im_start|>user\ngo<|im_end|>\n<|im_start|>assistant\n")
    r = s.end_turn(smollm2_tok.encode("hello", add_special_tokens=False) + [IM_END], "stop").result()
    assert "Error: the environment failed: ConnectionError" in smollm2_tok.decode(r.observation_tokens)
    r = s.end_turn(smollm2_tok.encode("again", add_special_tokens=False) + [IM_END], "stop").result()
    assert r.done and s.result().metrics["env_errors"] == 2 and s.result().finish_reason == "max_turns"


def test_server_down_at_start_is_a_config_error(smollm2_tok):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConfigError, match=f"rollout.agent.env: OpenEnv server {url} is not reachable"):
        build_agent({"env": {"_component_": "torchrlhf.agents.OpenEnv", "base_url": url}, "reward": "env"},
                    smollm2_tok, max_tokens=50)
