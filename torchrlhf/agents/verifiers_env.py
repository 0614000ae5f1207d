"""verifiers environments (PrimeIntellect's ``verifiers`` 0.1.3 API) as a rollout source.

Config (``rollout.agent``)::

    rollout:
      agent:
        verifiers: {env: my_env_module, args: {num_examples: 100}}   # verifiers.load_environment(env, **args)
        # or a module file not installed as a package: {env: envs/my_env.py, args: {...}}
        reward: env          # the rubric's score is the trajectory's reward
        max_turns: 4
    data: {train_files: []}  # the environment's dataset is the prompts

The environment module exports ``load_environment(**args)`` returning a ``vf.SingleTurnEnv`` /
``vf.MultiTurnEnv`` / ``vf.ToolEnv``. Its ``dataset`` (and ``eval_dataset``, when ``data.val_files`` is
empty) is written to ``<output_dir>/verifiers/{train,val}.jsonl`` and read as usual; its rubric scores
each trajectory when it ends. The multi-turn protocol runs in our `AgentSession`, so the model's tokens
are kept exactly and each ``env_response`` is rendered as a chat-template delta: unlike verifiers' own
rollout, nothing is re-tokenized between turns. A `ToolEnv`'s tool calls are read from the model's turn
in the hermes format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), as vLLM's hermes
parser reads them for verifiers; their results are joined into one observation.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from torchrlhf.agents.parsing import openai_tool_calls
from torchrlhf.agents.render import row_messages
from torchrlhf.config import ConfigError, load_callable

Message = dict[str, Any]


SUPPORTED = (">=0.1.3", "<0.1.4")  # the 0.1.3 API; the extra `torchrlhf[verifiers]` pins the same range


def import_verifiers() -> Any:
    """The ``verifiers`` module, when its version is one this adapter speaks; ConfigError naming the range otherwise
    (0.1.4-0.1.x changed ``is_completed`` and ``score_rollout``; 0.4 replaced the API with ``verifiers.v1``)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        raise ConfigError("rollout.agent.verifiers needs the verifiers package: pip install 'torchrlhf[verifiers]'") from None
    low, high = (Version(bound.lstrip("<>=")) for bound in SUPPORTED)
    if not low <= Version(installed) < high:
        raise ConfigError(f"rollout.agent.verifiers: verifiers {installed} is installed; this adapter supports "
                          f"verifiers{','.join(SUPPORTED)} (its 0.1.3 API): pip install 'torchrlhf[verifiers]'")
    import verifiers

    return verifiers


def load_verifiers_env(env: str, args: Mapping[str, Any] | None = None) -> Any:
    """``verifiers.load_environment(env, **args)``; ConfigError naming what is missing."""
    vf = import_verifiers()
    try:
        if env.endswith(".py"):  # a module file not installed as a package, e.g. one in the project's folder
            loaded = load_callable(f"{env}:load_environment", "verifiers environment")(**dict(args or {}))
        else:
            loaded = vf.load_environment(env, **dict(args or {}))
    except (ValueError, RuntimeError, AttributeError, FileNotFoundError) as e:
        raise ConfigError(f"rollout.agent.verifiers.env={env!r}: {e}") from e
    if not isinstance(loaded, vf.MultiTurnEnv):
        raise ConfigError(f"rollout.agent.verifiers.env={env!r}: load_environment returned {type(loaded).__name__}, "
                          "not a verifiers MultiTurnEnv (SingleTurnEnv, ToolEnv, ...)")
    if loaded.message_type != "chat":
        raise ConfigError(f"rollout.agent.verifiers.env={env!r}: only chat environments are supported "
                          f"(message_type={loaded.message_type!r})")
    return loaded


@functools.lru_cache(maxsize=8)
def _cached_env(env: str, args_json: str) -> Any:
    """The loaded environment, once per process (its hooks and rubric; its rows travel in the data files)."""
    return load_verifiers_env(env, json.loads(args_json))


def env_name(env: str) -> str:
    """The environment's name in metrics: its module name, or a module file's stem."""
    return os.path.splitext(os.path.basename(env))[0] if env.endswith(".py") else env


def verifiers_data_files(node: Mapping[str, Any], output_dir: str, val_files: Sequence[str]) -> tuple[list[str], list[str]]:
    """(train files, val files): the environment's dataset (and eval dataset, unless ``val_files`` are given)
    written as prompt files (``prompt`` messages, ``ground_truth`` = the row's answer, ``data_source`` = its task)."""
    loaded = _cached_env(node["env"], json.dumps(dict(node.get("args") or {}), sort_keys=True))
    folder = os.path.join(output_dir, "verifiers")
    os.makedirs(folder, exist_ok=True)

    def write(dataset: Any, name: str) -> str:
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            for i, row in enumerate(dataset):
                try:
                    line = json.dumps({
                        "prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
                        "ground_truth": str(row.get("answer", "")),
                        "data_source": row.get("task") or env_name(node["env"]),
                        # the row's own fields, read back by `VerifiersEnv.reset`: a sample carries its row, so rows
                        # that share a prompt text keep their own answer and info
                        "answer": row.get("answer", ""), "task": row.get("task") or "default",
                        "info": row.get("info") or {}, "verifiers_index": i})
                except TypeError as e:
                    raise ConfigError(f"rollout.agent.verifiers.env={node['env']!r}: {name} row {i}'s fields must be "
                                      f"JSON values (they travel in the data file): {e}") from e
                f.write(line + "\n")
        return path

    if loaded.dataset is None:
        raise ConfigError(f"rollout.agent.verifiers.env={node['env']!r} has no training dataset")
    train = [write(loaded.dataset, "train.jsonl")]
    if val_files or loaded.eval_dataset is None:
        return train, list(val_files)
    return train, [write(loaded.eval_dataset, "val.jsonl")]


class _Loop:
    """One event loop thread per process: verifiers' hooks are coroutines, and the engine thread that steps
    an environment may already run a loop of its own."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, awaitable: Any) -> Any:
        if not asyncio.iscoroutine(awaitable):
            return awaitable
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, daemon=True, name="verifiers-loop").start()
        return asyncio.run_coroutine_threadsafe(awaitable, cls._loop).result()


class VerifiersEnv:
    """A verifiers environment stepped by our agent session (one instance per trajectory).

    Args:
        env: the environment's module name (``verifiers.load_environment``'s ``env_id``).
        args: keyword arguments of its ``load_environment``.
    """

    def __init__(self, env: str, args: Mapping[str, Any] | None = None) -> None:
        self.name = env
        self.vf_env = _cached_env(env, json.dumps(dict(args or {}), sort_keys=True))
        self.messages: list[Message] = []
        self.completion: list[Message] = []
        self.state: dict[str, Any] = {}

    def reset(self, row: Mapping[str, Any]) -> None:
        """Start the episode of ``row``: its own ``answer``, ``info`` and ``task`` (written into the data file by
        `verifiers_data_files`; a user's own file gives ``answer`` or ``ground_truth``, and ``info`` if any)."""
        prompt = row_messages(row)  # the data file's prompt: the environment's own chat, its system prompt included
        answer = row["answer"] if row.get("answer") is not None else row.get("ground_truth") or ""
        self.messages = list(prompt)
        self.completion = []
        self.state = {"prompt": prompt, "completion": self.completion, "answer": answer,
                      "task": row.get("task") or "default", "info": dict(row.get("info") or {}), "responses": [],
                      "turn": 0}
        self.state = _Loop.run(self.vf_env.setup_state(self.state)) or self.state
        return None  # the row's prompt (the environment's own, with its system prompt) as is

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self._append_turn(text)
        if _Loop.run(self.vf_env.is_completed(self.messages, self.state)) or self.state["turn"] >= self.vf_env.max_turns:
            return None, self._score(), True
        env_messages, self.state = _Loop.run(self.vf_env.env_response(self.messages, self.state))
        if not isinstance(env_messages, list) or not all(isinstance(m, Mapping) and "content" in m for m in env_messages):
            raise TypeError(f"verifiers env {self.name!r}: env_response must return a list of messages, got {env_messages!r}")
        self.messages.extend(env_messages)
        self.completion.extend(env_messages)
        return "\n".join(str(m["content"]) for m in env_messages), 0.0, False

    def end_episode(self, text: str | None) -> float:
        """The session ended the episode first (the token budget, or ``max_turns``): the rubric scores it as it
        stands, with the cut turn's ``text`` as the last assistant message, as verifiers scores a truncated rollout."""
        if text is not None:
            self._append_turn(text)
        return self._score()

    def _append_turn(self, text: str) -> None:
        message: Message = {"role": "assistant", "content": text}
        if getattr(self.vf_env, "tool_map", None) is not None:
            calls = _hermes_tool_calls(text)
            if calls:
                message["tool_calls"] = calls
        self.messages.append(message)
        self.completion.append(message)
        self.state["responses"].append(text)
        self.state["turn"] += 1

    def _score(self) -> float:
        score = _Loop.run(self.vf_env.rubric.score_rollout(
            self.state["prompt"], self.completion, self.state["answer"], self.state,
            task=self.state["task"], info=self.state["info"]))
        return float(score.reward)


def _hermes_tool_calls(text: str) -> list[Any]:
    """The turn's tool calls as the OpenAI objects a `vf.ToolEnv` reads (blocks that are no call skipped: the env
    then sees a turn without that call)."""
    from verifiers.types import ChatCompletionMessageToolCall

    return [ChatCompletionMessageToolCall(**call) for call in openai_tool_calls(text)[1]]
