"""`AgentSpec` (the ``rollout.agent`` config, validated) and `Agent` (what a rollout worker holds).

Config (``rollout.agent``; every key optional except one of ``tools`` / ``env`` / ``harness``)::

    rollout:
      max_tokens: 256              # model tokens over all turns of a trajectory
      agent:
        tools: [calculator, my_pkg.tools:search, /path/tools.py:lookup]
        tool_calls:                # how the model's tool calls are written and run
          format: hermes           # hermes: <tool_call>{"name":..,"arguments":{..}}</tool_call>; tags: <calc>..</calc>
          tags: {calc: calculator} # format tags: tag -> tool (its one string argument is the tag's text)
          max_parallel: 4          # tool calls run per turn; more become error observations
        env: {_component_: torchrlhf.agents.builtin.GuessNumber, low: 1, high: 100}  # see torchrlhf.agents.env
        verifiers: {env: my_taskset, args: {}}  # a verifiers 0.4 environment: an episode per trajectory, run as a
                                   #   harness on the endpoint below (`torchrlhf.agents.verifiers_env`)
        max_turns: 4               # model turns (verl: multi_turn.max_assistant_turns)
        max_tool_response_tokens: 256   # longer observations are cut and marked (verl: max_tool_response_length)
        timeout_s: 10              # per tool call (in a worker process) and per environment call (in a thread)
        num_workers: 1             # tool worker processes
        isolate: true              # false: tools run in the calling thread, no worker processes, no time limit
        on_error: observe          # observe: the error is the model's observation; end: end the trajectory
        on_error_score: 0.0        # the score of a trajectory ended by an error (a harness's or episode's too)
        reward: reward_fn          # env (the env's rewards: step rewards or get_reward) | reward_fn (the run's reward
                                   # function on the final model turn, `Trajectory.final_text`) | sum
        check_tokens: off          # off | metric (token_mismatches) | error: re-render from text and compare
        observation:               # how tool results and env replies are shown to the model
          role: auto               # tool | user | auto (tool if the chat template knows a tool role)
          prefix: ""               # before a user-role observation's content
        harness:                   # instead of tools/env: the user's own agent (`torchrlhf.agents.harness`)
          fn: pkg.mod:run_agent    # run_agent(base_url, row) -> reward, an OpenAI client's agent (needs reward: env
                                   #   or sum); null (the default): no harness
          timeout_s: 300           # per trajectory (a harness's or a verifiers episode's)
          host: 127.0.0.1          # the endpoint's address (loopback: anyone reaching it can sample the policy)
          batch_wait_s: 0.2        # waiting calls are sampled together once every live trajectory has one, or
                                   #   after this long with none new (the other harnesses busy with their own work)

The whole trajectory (prompt + model turns + observations) is capped by ``max_trajectory_tokens``,
which the trainer derives from ``max_seq_len``. A model turn with tool calls gets their results; a
turn without one ends the trajectory (its text is the final answer the reward function grades,
`Trajectory.final_text`), unless an env is configured: then it is the env's action (as verl's
``interaction``), and the env says when the episode is done; a TRL-style env (``reset(**row)``) acts
through its methods, which are tools. As with TRL's ``environment_factory``, the env is built per
trajectory and ``reset`` gets the data row as written in the data file. How this differs from verl's
``ToolAgentLoop``: trajectories are token-exact (observations are the chat template's delta; the
model's tokens are never re-tokenized), engines keep a trajectory's KV cache between turns, and the
same `AgentSession` serves every engine and schedule.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from torchrlhf.agents.env import env_tools, is_tool_env, load_env_factory
from torchrlhf.agents.parsing import ToolCallParser
from torchrlhf.agents.render import ChatRenderer
from torchrlhf.agents.tools import ToolExecutor, load_tools
from torchrlhf.config import ConfigError, as_section, load_callable
from torchrlhf.config._errors import close_matches

log = logging.getLogger(__name__)


# The keys that moved into a section (relative to ``rollout.agent``): a config that sets one is told the new key.
MOVED_KEYS = {
    "harness": "harness.fn",  # was the "module:function" string; a mapping (or null) is the section
    "harness_timeout_s": "harness.timeout_s",
    "harness_host": "harness.host",
    "harness_batch_wait_s": "harness.batch_wait_s",
    "observation_role": "observation.role",
    "observation_prefix": "observation.prefix",
    "format": "tool_calls.format",
    "tags": "tool_calls.tags",
    "max_parallel_calls": "tool_calls.max_parallel",
}
# What a harness (and a verifiers environment, which runs as one) does not read: its agent runs its own loop, so our
# turn limits, tool settings, error handling and observation rendering have nothing to act on (a harness reads
# reward, on_error_score, check_tokens and the harness section).
HARNESS_IGNORES = ("tool_calls", "max_turns", "max_tool_response_tokens", "timeout_s", "num_workers", "isolate",
                   "on_error", "observation")


@dataclass(frozen=True)
class ToolCallSpec:
    """``rollout.agent.tool_calls``: how the model writes tool calls (`torchrlhf.agents.parsing.ToolCallParser`'s
    ``format`` and ``tags``) and how many of a turn's calls run (``max_parallel``; more become error observations)."""

    format: str = "hermes"
    tags: dict[str, str] = field(default_factory=dict)
    max_parallel: int = 4

    def __post_init__(self) -> None:
        if self.format not in ("hermes", "tags"):
            raise ValueError(f"format: must be 'hermes' or 'tags', got {self.format!r}")
        if self.max_parallel < 1:
            raise ValueError(f"max_parallel: must be >= 1, got {self.max_parallel}")


@dataclass(frozen=True)
class ObservationSpec:
    """``rollout.agent.observation``: how tool results and environment replies are rendered
    (`torchrlhf.agents.render.ChatRenderer`'s ``observation_role`` and ``observation_prefix``)."""

    role: str = "auto"
    prefix: str = ""

    def __post_init__(self) -> None:
        if self.role not in ("auto", "tool", "user"):
            raise ValueError(f"role: must be 'auto', 'tool' or 'user', got {self.role!r}")


@dataclass(frozen=True)
class HarnessSpec:
    """``rollout.agent.harness``: the user's agent function ``fn`` (``"module:function"`` or ``"path.py:function"``;
    None: no harness) and its OpenAI-compatible endpoint (`torchrlhf.agents.harness`), which a verifiers
    environment's episodes also use: ``timeout_s`` per trajectory, the ``host`` it binds to, ``batch_wait_s``."""

    fn: str | None = None
    timeout_s: float = 300.0
    host: str = "127.0.0.1"
    batch_wait_s: float = 0.2

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if not self.batch_wait_s >= 0:
            raise ValueError(f"batch_wait_s: must be >= 0, got {self.batch_wait_s}")


SECTIONS = {"tool_calls": ToolCallSpec, "observation": ObservationSpec, "harness": HarnessSpec}


@dataclass(frozen=True)
class AgentSpec:
    """The validated ``rollout.agent`` config; see the module docstring for each key. The sections
    (``tool_calls``, ``observation``, ``harness``) may be given as mappings, or None for their defaults."""

    tools: tuple[str, ...] = ()
    tool_calls: ToolCallSpec = field(default_factory=ToolCallSpec)
    env: dict[str, Any] | None = None
    verifiers: dict[str, Any] | None = None  # {env, args, val_args}: `torchrlhf.agents.verifiers_env`
    max_turns: int = 4
    max_tool_response_tokens: int | None = 256
    timeout_s: float = 10.0
    num_workers: int = 1
    on_error: str = "observe"
    on_error_score: float = 0.0
    reward: str = "reward_fn"
    check_tokens: str | bool = "off"  # YAML reads a bare `off` as False
    observation: ObservationSpec = field(default_factory=ObservationSpec)
    isolate: bool = True  # False: tools run in the calling thread, no time limit (tests, notebooks)
    harness: HarnessSpec = field(default_factory=HarnessSpec)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        for name, section in SECTIONS.items():
            object.__setattr__(self, name, _section(section, getattr(self, name), name))
        if isinstance(self.check_tokens, bool):
            object.__setattr__(self, "check_tokens", "metric" if self.check_tokens else "off")
        harness = self.harness.fn
        checks = [
            (self.tools or self.env or self.verifiers or harness, "needs tools, an env, verifiers or a harness"),
            (not (self.env and self.verifiers), "set env or verifiers, not both"),
            (not self.verifiers or (isinstance(self.verifiers, Mapping) and "env" in self.verifiers
                                    and set(self.verifiers) <= {"env", "args", "val_args"}),
             f"verifiers must be {{env: NAME, args: {{...}}, val_args: {{...}}}}, got {self.verifiers!r}"),
            (not self.verifiers or self.reward != "reward_fn",
             "verifiers: the episode's trace.reward scores the trajectory; set reward: env (or sum to add the "
             "reward function's)"),
            (not (harness and (self.tools or self.env or self.verifiers)),
             "harness runs the user's own agent (its tools included): leave tools, env and verifiers unset"),
            (not harness or self.reward in ("env", "sum"),
             f"harness returns the reward: set reward: env (or sum, to add the reward function's), got {self.reward!r}"),
            (self.max_turns >= 1, f"max_turns must be >= 1, got {self.max_turns}"),
            (self.timeout_s > 0 and self.num_workers >= 1, "need timeout_s > 0 and num_workers >= 1"),
            (self.on_error in ("observe", "end"), f"on_error must be 'observe' or 'end', got {self.on_error!r}"),
            (self.reward in ("env", "reward_fn", "sum"), f"reward must be 'env', 'reward_fn' or 'sum', got {self.reward!r}"),
            (self.reward == "reward_fn" or self.env or self.verifiers or harness,
             f"reward={self.reward!r} needs an env, verifiers or a harness"),
            (self.check_tokens in ("off", "metric", "error"),
             f"check_tokens must be 'off', 'metric' or 'error', got {self.check_tokens!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"rollout.agent: {message}")
        changed = _changed(self, HARNESS_IGNORES if harness or self.verifiers else ("harness",))
        if changed and harness:
            raise ConfigError(f"rollout.agent: {', '.join(changed)} do not apply to a harness: your agent runs its own "
                              "loop, tools and turns (rollout.max_tokens caps its model tokens, harness.timeout_s its "
                              "time); remove them")
        if changed and self.verifiers:
            raise ConfigError(f"rollout.agent: {', '.join(changed)} do not apply to a verifiers environment: its env "
                              "runs the turns and tools (its seat's max_turns and timeouts; rollout.max_tokens caps "
                              "the model tokens, harness.timeout_s an episode's time); remove them")
        if changed:
            raise ConfigError(f"rollout.agent: {', '.join(changed)} apply only with a harness or verifiers; remove them")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> AgentSpec:
        """Validate a ``rollout.agent`` mapping and `check` it, so a bad name fails now."""
        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)
        moved = [f"rollout.agent.{old}: moved to rollout.agent.{new}" for old, new in MOVED_KEYS.items()
                 if old in cfg and (old not in SECTIONS or not (cfg[old] is None or isinstance(cfg[old], Mapping)))]
        if moved:
            raise ConfigError("unsupported config keys:\n" + "\n".join(f"  - {m}" for m in moved))
        known = {f.name for f in dataclasses.fields(cls)}
        for key in cfg:
            if key not in known:
                raise ConfigError(f"rollout.agent: unknown key {key!r}{close_matches(str(key), known)}")
        spec = cls(**dict(cfg))
        spec.check()
        return spec

    def check(self) -> None:
        """`load` what the spec names, and ask an environment server whether it is up (`OpenEnv.check`): the
        config check, once, on the controller (rank 0) before any worker starts. The rollout workers receive the
        spec itself and `load` it once each; Python imports each module (or file) once per process."""
        env = self.load().env_factory
        if env is not None and hasattr(env.env_class, "check"):  # e.g. an OpenEnv server that is not up: fail now
            try:
                env.env_class.check(**env.keywords)
            except (ValueError, ConnectionError) as e:
                raise ConfigError(f"rollout.agent.env: {e}") from e

    def load(self) -> LoadedAgent:
        """What the spec names, imported: its tools, the environment factory, a tool environment's methods as tools
        and the harness; ConfigError naming what is missing."""
        try:
            tools = load_tools(list(self.tools))
        except (ValueError, ImportError, FileNotFoundError) as e:
            raise ConfigError(f"rollout.agent.tools: {e}") from e
        try:
            env = load_env_factory(self.env) if self.env else None
            methods = env_tools(env.env_class) if env is not None and is_tool_env(env.env_class) else {}
        except (ValueError, ImportError, FileNotFoundError) as e:
            raise ConfigError(f"rollout.agent.env: {e}") from e
        if set(methods) & set(tools):
            raise ConfigError(f"rollout.agent: tools and the env's methods share the names {sorted(set(methods) & set(tools))}")
        if methods and self.reward != "reward_fn" and not callable(getattr(env.env_class, "get_reward", None)):
            raise ConfigError(f"rollout.agent: reward={self.reward!r} needs env rewards; the tool environment "
                              f"{self.env['_component_']!r} has no get_reward()")
        try:
            if tools or methods:
                ToolCallParser({**tools, **methods}, self.tool_calls.format, self.tool_calls.tags or None)
        except ValueError as e:
            raise ConfigError(f"rollout.agent.tools: {e}") from e
        return LoadedAgent(tools, env, methods, self._load_harness())

    def _load_harness(self) -> Any:
        if self.verifiers:  # an episode per trajectory, on the harness endpoint; a config error fails here
            from torchrlhf.agents.verifiers_env import VerifiersEpisodes

            return VerifiersEpisodes(**self.verifiers)
        if not self.harness.fn:
            return None
        try:
            return load_callable(self.harness.fn, what="harness")
        except (ValueError, ImportError, FileNotFoundError) as e:
            raise ConfigError(f"rollout.agent.harness.fn: {e}") from e


@dataclass(frozen=True)
class LoadedAgent:
    """What `AgentSpec.load` imported: tools by name, the environment factory (None without one), a tool
    environment's methods as tools by name, and the harness function (None without one)."""

    tools: dict[str, Any]
    env_factory: Any
    env_tools: dict[str, Any]
    harness: Any


class Agent:
    """What a rollout worker holds: the spec, the chat renderer, the tool parser and executor; each trajectory
    is an `torchrlhf.agents.session.AgentSession` over it.

    Args:
        spec: the agent config.
        tokenizer: the policy's tokenizer (with its chat template).
        max_tokens: model tokens over all turns of a trajectory (``rollout.max_tokens``).
        max_trajectory_tokens: cap on prompt + response (model and observation tokens); from ``max_seq_len``.
    """

    def __init__(self, spec: AgentSpec, tokenizer: Any, *, max_tokens: int,
                 max_trajectory_tokens: int | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"Agent: max_tokens must be >= 1, got {max_tokens}")
        self.spec = spec
        self.max_tokens = int(max_tokens)
        self.max_trajectory_tokens = max_trajectory_tokens
        loaded = spec.load()
        tools, self.env_factory, self.env_tools, self.harness = (loaded.tools, loaded.env_factory, loaded.env_tools,
                                                                 loaded.harness)
        if spec.verifiers:  # rollout.max_tokens is the policy seat's max_output_tokens
            self.harness = self.harness.with_max_tokens(self.max_tokens)
        self.tool_env = bool(self.env_tools)  # TRL's shape: reset(**row), methods as tools, optional get_reward
        self.tools = {**tools, **self.env_tools}
        calls = spec.tool_calls
        self.parser = ToolCallParser(self.tools, calls.format, calls.tags or None) if self.tools else None
        self.renderer = ChatRenderer(
            tokenizer, tools=[t.schema for t in self.tools.values()] or None,
            observation_role=spec.observation.role, observation_prefix=spec.observation.prefix,
            max_observation_tokens=spec.max_tool_response_tokens)
        self.executor = ToolExecutor(spec.num_workers, spec.timeout_s, isolate=spec.isolate)
        if self.tools and calls.format == "hermes" and not self.renderer.template_uses_tools:
            log.warning("rollout.agent: the chat template ignores tools=, so the model is not shown the tools' "
                        "schemas; describe them (and the <tool_call> format) in the prompt")

    def close(self) -> None:
        """Stop the tool worker processes."""
        self.executor.close()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _section(cls: type, value: Any, name: str) -> Any:
    """The section ``name`` from itself, a mapping or None (its defaults); ConfigError naming ``rollout.agent.<name>``
    and the bad key (the recipe's validation reports these first, with the same names)."""
    if value is not None and not isinstance(value, (cls, Mapping)):
        raise ConfigError(f"rollout.agent.{name}: expected a mapping for section {cls.__name__}, got {value!r}")
    if isinstance(value, Mapping):
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ConfigError(f"rollout.agent.{name}: unknown key {unknown[0]!r}{close_matches(str(unknown[0]), known)}")
    try:
        return as_section(cls, value)
    except ValueError as e:  # "field: why"
        raise ConfigError(f"rollout.agent.{name}.{e}") from None


def _changed(spec: AgentSpec, names: tuple[str, ...]) -> list[str]:
    """The keys among ``names`` that ``spec`` sets to other than their defaults; a section's as ``section.key``."""
    changed = []
    for f in dataclasses.fields(spec):
        if f.name not in names:
            continue
        value = getattr(spec, f.name)
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            changed += [f"{f.name}.{g.name}" for g in dataclasses.fields(value)
                        if getattr(value, g.name) != getattr(default, g.name)]
        elif value != default:
            changed.append(f.name)
    return changed


def build_agent(cfg: AgentSpec | Mapping[str, Any], tokenizer: Any, *, max_tokens: int,
                max_trajectory_tokens: int | None = None) -> Agent:
    """An `Agent` from a validated `AgentSpec` (as the rollout worker receives it: loaded once, here), or from a
    ``rollout.agent`` mapping (validated and checked first)."""
    spec = cfg if isinstance(cfg, AgentSpec) else AgentSpec.from_config(cfg)
    return Agent(spec, tokenizer, max_tokens=max_tokens, max_trajectory_tokens=max_trajectory_tokens)
