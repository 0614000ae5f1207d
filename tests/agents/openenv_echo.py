"""An OpenEnv echo environment served by openenv-core's own server (`create_fastapi_app`) on loopback.

``python openenv_echo.py PORT``. The episode: reset says what to do; each step echoes the message back with a
reward of 0.1 per character (at most 1), done after two steps. The message ``sleep`` makes the step sleep 5 s
(a timeout test); ``crash`` makes it raise (a server error reply).
"""

from __future__ import annotations

import sys
import time

import uvicorn
from openenv.core.env_server import Action, Environment, Observation, create_fastapi_app
from openenv.core.env_server.types import State


class EchoAction(Action):
    message: str


class EchoObservation(Observation):
    echoed_message: str = ""


class EchoEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one environment instance per WebSocket session

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id="echo", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs) -> EchoObservation:
        self._state = State(episode_id=episode_id or "echo", step_count=0)
        return EchoObservation(echoed_message="Say something; I will repeat it.", done=False, reward=None)

    def step(self, action: EchoAction, timeout_s=None, **kwargs) -> EchoObservation:
        if action.message.strip() == "sleep":
            time.sleep(5)
        if action.message.strip() == "crash":
            raise RuntimeError("echo env crashed")
        self._state.step_count += 1
        return EchoObservation(echoed_message=action.message, done=self._state.step_count >= 2,
                               reward=min(1.0, 0.1 * len(action.message)))

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(EchoEnv, EchoAction, EchoObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
