"""OpenEnv environments (Meta / Hugging Face ``openenv-core``) as agent environments, over their WebSocket protocol.

Config (``rollout.agent``)::

    env:
      _component_: torchrlhf.agents.OpenEnv
      base_url: http://127.0.0.1:8000   # the server (``openenv serve``, a container, a Space)
      action_key: message               # the action field the model's turn text goes into
      observation_key: null             # the observation field shown to the model; null: all fields as JSON
      reset_args: {}                    # the reset message's data (seed, episode_id, ...)
      timeout_s: 30                     # per reset / step reply
    reward: env                          # the steps' rewards

Each trajectory opens its own ``/ws`` session (the server's per-connection environment instance), so the server
must allow as many concurrent sessions as trajectories run at once (``max_concurrent_envs``). The reset
observation (when not empty) is a user turn after the row's prompt; each step's observation is the next
observation, rendered as a chat-template delta. A reply that times out, a closed connection and a reply that is
not an OpenEnv observation raise here, which the session counts (``agent/env_errors``) and turns into an
error observation or the end of the trajectory (``on_error``). A server that is down when the config is checked is
a ConfigError before training (`OpenEnv.check`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any


def _websockets() -> tuple[Any, type[Exception]]:
    """(``connect``, ``WebSocketException``); imported on first use: ``websockets`` comes with ``openenv-core``."""
    try:
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect
    except ImportError:
        raise ImportError("torchrlhf.agents.OpenEnv needs websockets: pip install 'torchrlhf[openenv]'") from None
    return connect, WebSocketException


class OpenEnv:
    """One OpenEnv session per trajectory.

    Args:
        base_url: the server's http(s) address.
        action_key: the field of the action object that carries the model's turn text.
        observation_key: the observation field the model sees; None: the whole observation as JSON.
        reset_args: data of the reset message.
        timeout_s: how long to wait to connect and for each reply.
    """

    def __init__(self, base_url: str, action_key: str = "message", observation_key: str | None = None,
                 reset_args: Mapping[str, Any] | None = None, timeout_s: float = 30.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"OpenEnv: timeout_s must be > 0, got {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.action_key = action_key
        self.observation_key = observation_key
        self.reset_args = dict(reset_args or {})
        self.timeout_s = float(timeout_s)
        self._connection: Any = None  # websockets.sync.client.ClientConnection
        self._ws: Any = None  # the connection while a session is open

    @classmethod
    def check(cls, base_url: str, timeout_s: float = 30.0, **_: Any) -> None:
        """Raise ConnectionError unless the server answers ``GET /health``: called once when the config is checked."""
        url = base_url.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=min(float(timeout_s), 10.0)) as reply:
                status = reply.status
        except (urllib.error.URLError, OSError) as e:
            raise ConnectionError(f"OpenEnv server {base_url} is not reachable ({url}: {e})") from None
        if status != 200:
            raise ConnectionError(f"OpenEnv server {base_url}: GET /health answered {status}")

    def reset(self, row: Mapping[str, Any]) -> str | None:
        self.close()
        connect, WebSocketException = _websockets()
        ws_url = "ws" + self.base_url[len("http"):] + "/ws" if self.base_url.startswith("http") else self.base_url + "/ws"
        try:
            self._connection = connect(ws_url, open_timeout=self.timeout_s, close_timeout=1.0, max_size=2**24)
            self._ws = self._connection.__enter__()  # its context manager closes it (`close`)
        except (OSError, TimeoutError, WebSocketException) as e:
            raise ConnectionError(f"OpenEnv: cannot open a session at {ws_url}: {e}") from None
        observation, _, _ = self._call("reset", self.reset_args)
        return observation or None

    def step(self, text: str) -> tuple[str | None, float, bool]:
        if self._ws is None:
            raise RuntimeError("OpenEnv: step before reset (or after the session closed)")
        observation, reward, done = self._call("step", {self.action_key: text})
        if done:
            self.close()
        return observation, reward, done

    def close(self) -> None:
        if self._ws is not None:
            ws, self._ws = self._ws, None
            try:
                ws.send(json.dumps({"type": "close", "data": {}}))
                self._connection.__exit__(None, None, None)
            except Exception:  # noqa: BLE001 - a session that is already broken is closed either way
                pass

    def __del__(self) -> None:
        # A finalizer must not block: the garbage collector runs it on whatever thread it is on (at exit too),
        # and websockets' closing handshake joins its reader thread, which can deadlock there. Drop the socket.
        if self._ws is not None:
            self._ws = None
            try:
                self._connection.socket.close()
            except Exception:  # noqa: BLE001 - nothing to do in a finalizer
                pass

    def _call(self, kind: str, data: Mapping[str, Any]) -> tuple[str, float, bool]:
        """Send one message, read its reply: (observation text, reward, done)."""
        assert self._ws is not None
        _, WebSocketException = _websockets()
        try:
            self._ws.send(json.dumps({"type": kind, "data": dict(data)}))
            raw = self._ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            self.close()
            raise TimeoutError(f"OpenEnv {self.base_url}: no reply to {kind} within {self.timeout_s:g}s") from None
        except (OSError, WebSocketException) as e:
            self.close()
            raise ConnectionError(f"OpenEnv {self.base_url}: the session broke during {kind} ({e})") from None
        try:
            reply = json.loads(raw)
        except (json.JSONDecodeError, TypeError):
            raise ValueError(f"OpenEnv {self.base_url}: {kind} reply is not JSON: {str(raw)[:200]!r}") from None
        if isinstance(reply, Mapping) and reply.get("type") == "error":
            message = (reply.get("data") or {}).get("message", reply.get("data"))
            raise RuntimeError(f"OpenEnv {self.base_url}: the server failed the {kind}: {message}")
        payload = reply.get("data") if isinstance(reply, Mapping) else None
        if not (isinstance(payload, Mapping) and isinstance(payload.get("observation"), Mapping)):
            raise ValueError(f"OpenEnv {self.base_url}: {kind} reply is not an observation: {str(raw)[:200]!r}")
        reward, done = payload.get("reward"), payload.get("done", False)
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise ValueError(f"OpenEnv {self.base_url}: {kind} reward must be a number or null, got {reward!r}")
        return self._text(payload["observation"]), float(reward or 0.0), bool(done)

    def _text(self, observation: Mapping[str, Any]) -> str:
        if self.observation_key is None:
            return json.dumps(dict(observation), sort_keys=True)
        if self.observation_key not in observation:
            raise ValueError(f"OpenEnv {self.base_url}: the observation has no field {self.observation_key!r} "
                             f"(rollout.agent.env.observation_key); fields: {sorted(observation)}")
        return str(observation[self.observation_key])
