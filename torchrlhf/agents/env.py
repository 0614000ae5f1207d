"""Environments: stateful per trajectory, built once per trajectory from a class named in config.

``rollout.agent.env: {_component_: pkg.mod.Env, **kwargs}`` (or ``/path/file.py:Env``); the other
keys are constructor arguments. Two shapes of class are accepted, told apart by ``reset``'s signature:

- **step environments** (this library's shape; ``reset`` takes the row positionally)::

      first = env.reset(row)                      # str: a user turn after the row's prompt;
                                                  # a list of messages: the whole initial context; None: the prompt
      observation, reward, done = env.step(text)  # text: the model's turn, decoded without special tokens
      reward = env.end_episode(text_or_none)      # optional: the session ended the episode before the env said
                                                  # done (the token budget, max_turns); text: the cut last turn
                                                  # that step never got, else None. Added to the last turn's reward

- **tool environments** (TRL's ``environment_factory`` shape; ``reset`` takes keywords only, or nothing)::

      first = env.reset(**row)      # str: appended as a user turn; None: the prompt as is
      env.some_tool(arg=...)        # every public method is a tool the model calls (schema from its
                                    # type hints and docstring ``Args:``); its return value, as text, is the observation
      reward = env.get_reward()     # optional, no arguments: the trajectory's environment reward, once at its end

  A turn with no tool call ends the trajectory (its text is the final answer), as with plain tools.

``row`` is the data row as read from the data file (every column, values unchanged). Environment code
runs in the rollout process, in a thread, under ``rollout.agent.timeout_s`` per call: Python cannot
stop a thread, so a call past its limit is abandoned (left running) and its trajectory ends with
``on_error_score``. An environment that raises or returns a wrong type is counted in ``env_errors``
and becomes an error observation (``on_error: observe``) or ends the trajectory (``on_error: end``);
one whose ``reset`` fails or times out has no state to continue from, so its trajectory always ends.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import threading
import types
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Protocol, runtime_checkable

from torchrlhf.agents.tools import Tool, load_tool
from torchrlhf.config import ConfigError, load_callable
from torchrlhf.utils.isolated import CallTimeout

Message = dict[str, Any]

# Methods of a tool environment that are not tools (TRL reserves the same names).
RESERVED = ("reset", "get_reward")


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> str | list[Message] | None: ...

    def step(self, text: str) -> tuple[str | None, float, bool]: ...


def is_tool_env(cls: type) -> bool:
    """True for TRL's shape (``reset(**row)``, methods as tools): ``reset`` has no positional parameter."""
    params = list(inspect.signature(cls.reset).parameters.values())[1:]  # after self
    return not any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)


def env_tool_methods(cls: type) -> dict[str, Callable[..., Any]]:
    """A tool environment's tools: its public methods other than `RESERVED`, by name."""
    return {name: fn for name, fn in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in RESERVED}


def load_env_factory(node: Mapping[str, Any]) -> Callable[[], Any]:
    """A zero-argument constructor from ``{_component_: pkg.mod.Env, **kwargs}``; ConfigError when it is not one.

    The factory's ``env_class`` attribute is the class (`is_tool_env` tells its shape)."""
    if not isinstance(node, Mapping) or "_component_" not in node:
        raise ConfigError(f"agent env must be a mapping with '_component_', got {node!r}")
    path = node["_component_"]
    kwargs = {k: v for k, v in node.items() if k != "_component_"}
    cls = load_callable(path, what="environment")
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"agent env {path!r} is not an environment: need a class with reset(row) and step(text), "
                          "or TRL's shape: reset(**row) and public methods as tools")
    if is_tool_env(cls):
        if not env_tool_methods(cls):
            raise ConfigError(f"agent env {path!r}: reset(**row) makes it a tool environment, but it has no public "
                              "method to use as a tool")
    elif not callable(getattr(cls, "step", None)):
        raise ConfigError(f"agent env {path!r}: reset(row) takes the row positionally, so it needs step(text); "
                          "for TRL's shape (methods as tools) write reset(self, **row)")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"agent env {path!r}: {e} (arguments given: {sorted(kwargs)})") from e
    factory = functools.partial(cls, **kwargs)
    factory.env_class = cls  # type: ignore[attr-defined]
    return factory


def env_tools(cls: type) -> dict[str, Tool]:
    """A tool environment's methods as `Tool`s (schema and argument checks without ``self``); the session
    calls them on its own instance. ValueError (naming the method) when a schema cannot be derived."""
    tools = {}
    for name, fn in env_tool_methods(cls).items():
        tool = load_tool(types.MethodType(fn, object()))  # bound to a placeholder: no `self` in the schema
        tools[name] = dataclasses.replace(tool, target=f"{cls.__qualname__}.{name}")
    return tools


def _started(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """A future of ``fn(*args, **kwargs)`` run in a daemon thread (a result that comes after the future was
    resolved otherwise, by a timeout, is dropped)."""
    future: Future = Future()

    def run() -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the caller sees it through the future
            if not future.done():
                future.set_exception(e)
            return
        if not future.done():
            future.set_result(value)

    threading.Thread(target=run, daemon=True, name="torchrlhf-env").start()
    return future


def _timeout_error(fn: Callable[..., Any], timeout_s: float) -> CallTimeout:
    return CallTimeout(f"{getattr(fn, '__name__', fn)} ran past {timeout_s:g}s")


def call_in_thread(fn: Callable[..., Any], timeout_s: float, *args: Any, **kwargs: Any) -> Future:
    """A future of ``fn(*args, **kwargs)`` run in a daemon thread; `CallTimeout` after ``timeout_s``.

    A call past its limit cannot be stopped (Python threads cannot be killed): it is abandoned."""
    future = _started(fn, *args, **kwargs)

    def expire() -> None:
        if not future.done():
            try:
                future.set_exception(_timeout_error(fn, timeout_s))
            except Exception:  # noqa: BLE001 - finished in between
                pass

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    future.add_done_callback(lambda _: timer.cancel())
    return future


def call_with_timeout(fn: Callable[..., Any], timeout_s: float, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, waited for at most ``timeout_s``; raises `CallTimeout` past it (the call is
    abandoned, as in `call_in_thread`). The caller waits itself: one thread per call, no timer thread (an
    environment's step is called at every turn)."""
    future = _started(fn, *args, **kwargs)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        if not future.done():
            raise _timeout_error(fn, timeout_s) from None  # nobody reads the future after this
        return future.result()  # ``fn``'s own TimeoutError, raised again, or a result that came just now


def check_reset(result: Any, *, tool_env: bool) -> str | list[Message] | None:
    """``reset``'s return value checked: a string, None, or (step environments) a list of messages."""
    if result is None or isinstance(result, str):
        return result
    if not tool_env and isinstance(result, list) and all(isinstance(m, Mapping) and "role" in m for m in result):
        return result
    want = "a string or None" if tool_env else "a string, a list of messages or None"
    raise TypeError(f"reset must return {want}, got {type(result).__name__}")


def check_step(result: Any) -> tuple[str | None, float, bool]:
    """``step``'s return value checked: ``(observation str | None, finite reward, done bool)``."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"step must return (observation, reward, done), got {result!r}")
    observation, reward, done = result
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"step's observation must be a string or None, got {type(observation).__name__}")
    return observation, check_reward(reward, "step's reward"), bool(done)


def check_reward(reward: Any, what: str = "get_reward") -> float:
    """A finite number (not a bool) as float; TypeError naming ``what`` otherwise."""
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward or abs(reward) == float("inf"):
        raise TypeError(f"{what} must be a finite number, got {reward!r}")
    return float(reward)


def tool_env_observation(value: Any) -> str:
    """A tool environment method's return value as observation text (TRL's tools return numbers and JSON too)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float, list, dict)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"returned {type(value).__name__}; a tool returns a string, a number, or JSON-able lists/dicts")
