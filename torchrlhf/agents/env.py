"""Environments: stateful per trajectory, stepped with the model's turn text.

An environment is a class named in config with ``_component_`` (its other keys are constructor
arguments), built once per trajectory::

    env = GuessNumber(low=1, high=100)
    first = env.reset(row)                     # str: a user turn after the row's prompt;
                                               # a list of messages: the whole initial context; None: the prompt as is
    observation, reward, done = env.step(text)  # text: the model's turn, decoded without special tokens

Environments run in the engine's process, in the thread that calls `AgentSession.end_turn`, with
no time limit: an environment is trusted code whose ``step`` is cheap (a rule, a lookup). Keeping
it in-process keeps its state where the trajectory is; work that is slow or untrusted (running
model-written code, a web call) belongs in a tool, which runs isolated under a time limit. An
environment that raises is counted and becomes an error observation (or ends the trajectory).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

from torchrlhf.config import ConfigError, load_callable

Message = dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> str | list[Message] | None: ...

    def step(self, text: str) -> tuple[str | None, float, bool]: ...


def load_env_factory(node: Mapping[str, Any]) -> Callable[[], Environment]:
    """A zero-argument constructor from ``{_component_: pkg.mod.Env, **kwargs}``; ConfigError when it is not one."""
    if not isinstance(node, Mapping) or "_component_" not in node:
        raise ConfigError(f"agent env must be a mapping with '_component_', got {node!r}")
    path = node["_component_"]
    kwargs = {k: v for k, v in node.items() if k != "_component_"}
    cls = load_callable(path, what="environment")
    if not inspect.isclass(cls) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise ConfigError(f"agent env {path!r} is not an environment: need a class with reset(row) and step(text)")
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f"agent env {path!r}: {e} (arguments given: {sorted(kwargs)})") from e
    return functools.partial(cls, **kwargs)


def check_step(result: Any) -> tuple[str | None, float, bool]:
    """``step``'s return value checked: ``(observation str | None, finite reward, done bool)``."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"step must return (observation, reward, done), got {result!r}")
    observation, reward, done = result
    if observation is not None and not isinstance(observation, str):
        raise TypeError(f"step's observation must be a string or None, got {type(observation).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward or abs(reward) == float("inf"):
        raise TypeError(f"step's reward must be a finite number, got {reward!r}")
    return observation, float(reward), bool(done)
