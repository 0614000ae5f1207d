"""verifiers environments (PrimeIntellect's ``verifiers`` 0.4, ``verifiers.v1``) as a rollout source.

Config (``rollout.agent``)::

    rollout:
      agent:
        verifiers:
          env: my_taskset          # a module exporting a vf.Taskset (and optionally a vf.Env), or envs/my_taskset.py
          args: {num_tasks: 100}   # its TasksetConfig fields (training rows)
          val_args: {split: test}  # optional: the fields of the validation rows, merged over args
        reward: env                # the episode's trace.reward is the trajectory's reward
    data: {train_files: [], val_files: []}   # the taskset's tasks are the prompts

verifiers 0.4 calls the model itself: an episode (``Env.run``) runs harness segments whose every model call goes
through verifiers' interception server to an OpenAI-compatible endpoint. So an episode is a black-box harness of
ours (`torchrlhf.agents.harness`): `VerifiersEpisodes` is the ``run_agent(base_url, row) -> reward`` that the
rollout worker's `HarnessRunner` calls once per trajectory, and ``base_url`` is the worker's endpoint, which samples
the policy token-exactly (each call after the first is the chat template's delta after the sampled tokens). The
env's policy seat plays through `torchrlhf.agents.verifiers_harness` (a chat loop in this process; its harness and
runtime config are replaced, its turn limits and timeouts kept), and ``rollout.max_tokens`` becomes its
``max_output_tokens``: verifiers refuses the turn after the budget is spent and scores the episode as it stands.

The trajectory's reward is the seat's ``trace.reward`` (the weighted ``@vf.reward`` hooks, and what ``Env.finalize``
records). An episode that is not ``ok`` (a reward or ``Env.run`` that raised, a harness or model-call failure, the
episode's deadline) raises `EpisodeError`, which the harness runner counts (``agent/agent_error``) and scores
``on_error_score``: verifiers leaves a failed trace's rewards unset, so it is never a silent 0. (A seat's stage
deadline is a stop, as a limit is: verifiers scores that trace.)

The rows: `verifiers_data_files` writes the taskset's tasks (``args``; ``val_args`` for the validation rows) as
prompt files; each row carries the task's identity (its split, ``idx`` and ``key``), by which the episode finds
the task again (never by its prompt text).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import importlib.util
import json
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchrlhf.config import ConfigError

log = logging.getLogger(__name__)

SUPPORTED = (">=0.4", "<0.5")  # the verifiers.v1 API of 0.4.x; the extra `torchrlhf[verifiers]` pins the same range
KEY_VAR = "TORCHRLHF_VERIFIERS_KEY"  # the env variable verifiers reads our endpoint's API key from (any value)
MODEL = "policy"  # the model name in verifiers' requests (our endpoint serves the policy under any name)
_LOADING = threading.Lock()  # the first trajectories of a process load the tasks and the envs once, not each


class EpisodeError(RuntimeError):
    """An episode that did not end in a scored trace: the harness runner makes it an error sample."""


def import_verifiers() -> Any:
    """``verifiers.v1``, when the installed verifiers is one this adapter speaks; ConfigError naming the range
    otherwise (0.1.x has another API: ``load_environment``, ``MultiTurnEnv``, ``Rubric``)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    try:
        installed = version("verifiers")
    except PackageNotFoundError:
        raise ConfigError("rollout.agent.verifiers needs the verifiers package: pip install 'torchrlhf[verifiers]'") from None
    low, high = (Version(bound.lstrip("<>=")) for bound in SUPPORTED)
    if not low <= Version(installed) < high:
        raise ConfigError(f"rollout.agent.verifiers: verifiers {installed} is installed; this adapter supports "
                          f"verifiers{','.join(SUPPORTED)} (its verifiers.v1 API): pip install 'torchrlhf[verifiers]'")
    import verifiers.v1 as vf

    return vf


def taskset_id(env: str) -> str:
    """The taskset id verifiers imports: a top-level module name, or a module file imported under its stem (so a
    module that is not installed, e.g. one in the project's folder, loads too)."""
    if not env.endswith(".py"):
        if "." in env or "/" in env:
            raise ConfigError(f"rollout.agent.verifiers.env={env!r}: verifiers imports a taskset by its top-level "
                              "module name; give that name, or the path of a module file (envs/my_taskset.py)")
        return env
    path = os.path.realpath(env)  # one file reached through a symlink is still one module
    if not os.path.isfile(path):
        raise ConfigError(f"rollout.agent.verifiers.env: file not found: {env}")
    name = os.path.splitext(os.path.basename(path))[0]
    loaded = sys.modules.get(name)
    if loaded is not None:
        if os.path.realpath(getattr(loaded, "__file__", "") or "") != path:
            raise ConfigError(f"rollout.agent.verifiers.env={env!r}: a module named {name!r} is already imported "
                              f"from {getattr(loaded, '__file__', None)}; rename the file")
        return name
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: verifiers (and pickling) import it by this name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return name


@dataclass(frozen=True)
class Source:
    """A verifiers environment as the rollout source reads it: the env config of each split and its policy seat."""

    name: str  # the taskset id: the rows' data_source, so the validation metric is val/<name>/acc
    configs: dict[str, Any]  # split -> the resolved vf.EnvConfig (its policy seat on our harness)
    seat: str  # the policy seat: the one agent field without a client of its own


def load_source(env: str, args: Mapping[str, Any] | None = None, val_args: Mapping[str, Any] | None = None,
                max_tokens: int | None = None) -> Source:
    """The environment's configs (``val`` only with ``val_args``), checked: ConfigError naming what is wrong."""
    vf = import_verifiers()
    from torchrlhf.agents.verifiers_harness import register

    harness_id = register()
    where = f"rollout.agent.verifiers.env={env!r}"
    try:
        name = taskset_id(env)
        config_type = vf.env_config_type(name)
    except (ImportError, AttributeError, TypeError, ValueError, SyntaxError) as e:
        raise ConfigError(f"{where}: {e}") from e
    seats = {n: f.default for n, f in config_type.model_fields.items() if isinstance(f.default, vf.AgentConfig)}
    policy = [n for n, seat in seats.items() if seat.client is None]
    if len(policy) != 1:
        raise ConfigError(f"{where}: its env must have exactly one agent seat on the run's model (a seat without a "
                          f"client of its own, which the policy plays), got {policy or 'none'} of {list(seats)}")
    seat_config: dict[str, Any] = {"harness": {"id": harness_id}, "runtime": {"type": "subprocess"}}
    if max_tokens is not None:
        cap = seats[policy[0]].max_output_tokens
        seat_config["max_output_tokens"] = max_tokens if cap is None else min(cap, max_tokens)
    configs = {}
    for split, fields in (("train", dict(args or {})), ("val", None if val_args is None else
                                                         {**dict(args or {}), **dict(val_args)})):
        if fields is None:
            continue
        try:
            configs[split] = vf.resolve_env_config({"taskset": {**fields, "id": name}, policy[0]: seat_config})
        except ValueError as e:  # pydantic's ValidationError: a field the taskset's config does not have, ...
            raise ConfigError(f"{where}: {'args' if split == 'train' else 'val_args'}: {e}") from e
        except (ImportError, AttributeError, TypeError) as e:  # the module, or its exported classes
            raise ConfigError(f"{where}: {e}") from e
    return Source(name, configs, policy[0])


@functools.lru_cache(maxsize=8)
def _tasks(env: str, args_json: str, val_args_json: str, split: str) -> dict[int, Any]:
    """The split's tasks by ``idx``, once per process (iterating a taskset runs its ``load()``)."""
    vf = import_verifiers()
    source = load_source(env, json.loads(args_json), json.loads(val_args_json))
    taskset = vf.load_taskset(source.configs[split].taskset)
    if not taskset.bounded:
        raise ConfigError(f"rollout.agent.verifiers.env={env!r}: the taskset is infinite (INFINITE = True); give it "
                          "a config whose load() ends")
    return {task.data.idx: task for task in taskset}


def verifiers_data_files(node: Mapping[str, Any], output_dir: str, val_files: Sequence[str]) -> tuple[list[str], list[str]]:
    """(train files, val files): the taskset's tasks written as prompt files (``prompt`` = its system prompt and
    prompt as chat messages, ``ground_truth`` = its ``answer`` field if it has one, ``data_source`` = the taskset
    id, and the task's identity); the validation rows from ``val_args``, unless ``val_files`` are given."""
    source = load_source(node["env"], node.get("args"), node.get("val_args"))
    folder = os.path.join(output_dir, "verifiers")
    os.makedirs(folder, exist_ok=True)

    def write(split: str) -> str:
        path = os.path.join(folder, f"{split}.jsonl")
        tasks = _tasks(node["env"], *_keys(node), split)
        with open(path, "w") as f:
            for idx, task in tasks.items():
                f.write(json.dumps(_row(source.name, split, idx, task)) + "\n")
        return path

    train = [write("train")]
    if val_files or "val" not in source.configs:
        return train, list(val_files)
    return train, [write("val")]


def _keys(node: Mapping[str, Any]) -> tuple[str, str]:
    return (json.dumps(dict(node.get("args") or {}), sort_keys=True),
            json.dumps(None if node.get("val_args") is None else dict(node["val_args"]), sort_keys=True))


def _row(name: str, split: str, idx: int, task: Any) -> dict[str, Any]:
    """A task as a data row: its chat (a prompt-less task, which the env opens, is refused), its answer, its identity."""
    data = task.data
    where = f"rollout.agent.verifiers.env={name!r}: task {idx}"
    if data.prompt is None:
        raise ConfigError(f"{where} has no prompt (the env opens the conversation); only prompted tasks are supported")
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt:
            if not isinstance(m.content, str):
                raise ConfigError(f"{where}: only text messages are supported, got {m.content!r}")
            messages.append({"role": m.role, "content": m.content})
    answer = getattr(data, "answer", None)
    return {"prompt": messages, "ground_truth": "" if answer is None else str(answer), "data_source": name,
            "verifiers_split": split, "verifiers_idx": idx, "verifiers_key": task.key}


class _Loop:
    """One event loop thread per process: verifiers runs episodes as coroutines, each environment's serving
    resources (its interception server) live on this loop, and the harness runner calls each trajectory from a
    thread of its own."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, awaitable: Any) -> Any:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, daemon=True, name="verifiers-loop").start()
        return asyncio.run_coroutine_threadsafe(awaitable, cls._loop).result()


@functools.lru_cache(maxsize=8)
def _serving_env(env: str, args_json: str, val_args_json: str, split: str, max_tokens: int | None) -> Any:
    """The split's environment, loaded once per process, with its serving resources (the interception server, the
    taskset's shared tools) up until the process exits."""
    vf = import_verifiers()
    source = load_source(env, json.loads(args_json), json.loads(val_args_json), max_tokens)
    loaded = vf.load_environment(source.configs[split])
    serving = loaded.serving()
    _Loop.run(serving.__aenter__())
    atexit.register(_stop_serving, serving)
    return loaded


def _stop_serving(serving: Any) -> None:
    try:
        _Loop.run(asyncio.wait_for(serving.__aexit__(None, None, None), timeout=10))
    except Exception as e:  # noqa: BLE001 - at exit: a server that does not stop cleanly is left to the OS
        log.debug("verifiers: stopping the environment's servers: %s", e)


class VerifiersEpisodes:
    """``run_agent(base_url, row) -> reward``: one verifiers episode of the row's task, its policy seat sampled
    through ``base_url`` (the harness runner's per-trajectory endpoint).

    Args:
        env: the taskset's module name, or a module file.
        args: its TasksetConfig fields (training rows).
        val_args: the fields of the validation rows (their top-level keys replace those of ``args``).
        max_tokens: the seat's ``max_output_tokens`` (``rollout.max_tokens``); `Agent` sets it.
    """

    def __init__(self, env: str, args: Mapping[str, Any] | None = None, val_args: Mapping[str, Any] | None = None,
                 max_tokens: int | None = None) -> None:
        self.env, self.args, self.val_args, self.max_tokens = env, dict(args or {}), val_args, max_tokens
        self.source = load_source(env, self.args, val_args, max_tokens)  # a config error fails now, on every rank
        vf = import_verifiers()
        try:
            for config in self.source.configs.values():
                vf.load_environment(config)  # the taskset class, the env class and the harness load
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise ConfigError(f"rollout.agent.verifiers.env={env!r}: {e}") from e

    def with_max_tokens(self, max_tokens: int) -> VerifiersEpisodes:
        """The same episodes with the seat's ``max_output_tokens`` (the agent knows ``rollout.max_tokens``)."""
        return VerifiersEpisodes(self.env, self.args, self.val_args, max_tokens)

    def __call__(self, base_url: str, row: Mapping[str, Any]) -> float:
        vf = import_verifiers()
        keys = _keys({"args": self.args, "val_args": self.val_args})
        split, idx = row.get("verifiers_split", "train"), row.get("verifiers_idx")
        if split not in self.source.configs or not isinstance(idx, int):
            raise EpisodeError(f"the row names no task of the environment (verifiers_split={split!r}, "
                               f"verifiers_idx={idx!r}); its rows come from verifiers_data_files")
        with _LOADING:
            task = _tasks(self.env, *keys, split).get(idx)
            env = _serving_env(self.env, *keys, split, self.max_tokens)
        if task is None or task.key != row.get("verifiers_key"):
            raise EpisodeError(f"{split} task {idx} of {self.source.name!r} is not the task its row was written from "
                               "(does the taskset's load() give the same tasks in every process?)")
        os.environ.setdefault(KEY_VAR, "torchrlhf")
        ctx = vf.ModelContext(model=MODEL, client=vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR))
        episode = _Loop.run(env.run_episode(task, ctx))
        traces = [t for t in episode.traces if t.agent is not None and t.agent.name == self.source.seat]
        if episode.errors or not episode.ok:
            error = episode.last_error or next((t.last_error for t in traces if t.last_error), None)
            raise EpisodeError(f"the episode failed ({_describe(error, traces)})")
        if len(traces) != 1:
            raise EpisodeError(f"the env ran its policy seat {self.source.seat!r} {len(traces)} times in one episode; "
                               "one trajectory is one run of the seat")
        return float(traces[0].reward)


def _describe(error: Any, traces: Sequence[Any]) -> str:
    stops = ", ".join(str(t.stop_condition) for t in traces)
    what = f"{error.type}: {error.message}" if error is not None else "no error recorded"
    return f"{what}; stop condition: {stops or 'no trace'}"
