"""Tools: plain Python functions with type hints and a docstring, run in worker processes.

A tool is named in config by spec — ``my_pkg.tools:search``, ``my_pkg.tools.search``,
``/path/tools.py:search`` — or by a built-in name (``calculator``). Its JSON schema (the OpenAI /
HF ``tools=`` format the chat template shows the model) comes from the signature and the
docstring's ``Args:`` section via ``transformers.utils.get_json_schema``. A tool returns a string:
the observation the model sees.

Security: tool code runs with the permissions of the user who launched training, in worker
processes with a time limit (`ToolExecutor`, on the same `IsolatedPool` as reward functions). A
time limit bounds a call, not what it can do: only configure code you trust, and sandbox anything
that runs model-written code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torchrlhf.config import load_callable
from torchrlhf.utils.isolated import IsolatedPool

BUILTIN_TOOLS: dict[str, str] = {"calculator": "torchrlhf.agents.builtin:calculator"}

_JSON_TYPES: dict[Any, tuple[type, ...]] = {str: (str,), int: (int,), float: (int, float), bool: (bool,),
                                            list: (list,), dict: (dict,)}


@dataclass(frozen=True)
class Tool:
    """A loaded tool: its function, what a worker process calls, and its JSON schema."""

    name: str
    fn: Callable[..., Any]
    target: Callable[..., Any] | str  # the spec string when loaded from one (workers import it by name)
    schema: dict[str, Any]
    parameters: tuple[str, ...]  # in signature order

    def check_arguments(self, arguments: Mapping[str, Any]) -> str | None:
        """Why ``fn(**arguments)`` cannot be called (missing/unknown/mistyped arguments), or None."""
        sig = inspect.signature(self.fn)
        try:
            sig.bind(**arguments)
        except TypeError as e:
            return f"bad arguments for {self.name!r}: {e}; parameters: {list(self.parameters)}"
        for key, value in arguments.items():
            expected = _JSON_TYPES.get(sig.parameters[key].annotation) if key in sig.parameters else None
            if expected and (not isinstance(value, expected) or (bool not in expected and isinstance(value, bool))):
                want = sig.parameters[key].annotation.__name__
                return f"bad arguments for {self.name!r}: {key!r} must be {want}, got {type(value).__name__}"
        return None


def load_tool(spec: str | Callable[..., Any]) -> Tool:
    """A `Tool` from a built-in name, a spec string or a function; ValueError when it cannot be one."""
    target: Callable[..., Any] | str
    if isinstance(spec, str):
        target = BUILTIN_TOOLS.get(spec, spec)
        fn = load_callable(target, what="tool")
    elif callable(spec):
        fn = target = spec
    else:
        raise ValueError(f"a tool is a function or a 'pkg.mod:fn' / '/path/file.py:fn' string, got {spec!r}")
    if inspect.isclass(fn):
        raise ValueError(f"tool {spec!r} is a class; a tool is a function")
    from transformers.utils import get_json_schema  # imported here: only tool users pay for it

    try:
        schema = get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - get_json_schema raises several types for the same problem
        raise ValueError(f"tool {spec!r}: cannot derive its JSON schema ({e}). A tool needs type hints and a "
                         "docstring with an 'Args:' section describing every argument.") from e
    params = tuple(p for p, v in inspect.signature(fn).parameters.items()
                   if v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD))
    return Tool(name=fn.__name__, fn=fn, target=target, schema=schema, parameters=params)


def load_tools(specs: Sequence[str | Callable[..., Any]]) -> dict[str, Tool]:
    """Tools by name; ValueError on a name given twice."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ValueError(f"two tools are named {tool.name!r}")
        tools[tool.name] = tool
    return tools


class ToolExecutor:
    """Runs tool calls without blocking the caller: `submit` returns a future per call.

    Args:
        num_workers: worker processes (calls in flight).
        timeout_s: time limit of one call; a call past it fails with `CallTimeout`.
        isolate: False runs calls in the calling thread, with no time limit (trusted code, tests).
    """

    def __init__(self, num_workers: int = 1, timeout_s: float = 10.0, *, isolate: bool = True) -> None:
        self.timeout_s = float(timeout_s)
        self.pool = IsolatedPool(num_workers, timeout_s) if isolate else None

    def submit(self, tool: Tool, arguments: Mapping[str, Any]) -> Future:
        """A future of ``tool(**arguments)``: its return value, or the exception it ended with."""
        if self.pool is not None:
            return self.pool.submit(tool.target, kwargs=dict(arguments))
        future: Future = Future()
        try:
            future.set_result(tool.fn(**arguments))
        except Exception as e:  # noqa: BLE001 - a failing tool is the model's observation, not our crash
            future.set_exception(e)
        return future

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
