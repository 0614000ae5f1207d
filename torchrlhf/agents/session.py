"""The per-trajectory agent state machine that every engine drives.

Engines only schedule tokens; the agent logic lives here, once. For each trajectory (sample)::

    session = AgentSession(agent, row)            # renders the prompt (env.reset, tools=)
    tokens = session.prompt_tokens
    while (budget := session.turn_budget()) > 0:   # 0: done (or a turn is pending)
        turn = <sample up to `budget` tokens after `tokens`, stopping at the end-of-turn token>
        future = session.end_turn(turn, "stop" | "length")
        ...                                        # poll future.done() between decode steps
        result = future.result()                   # TurnResult
        if result.done: break
        tokens += turn + result.observation_tokens # prefill only these (the KV cache holds the rest)
    trajectory = session.result()

Between turns the engine keeps the trajectory's KV cache: the observation tokens are the only new
input (no re-prefill). Every `TurnResult` with observation tokens leaves ``turn_budget() >= 1``.
Threading: a session is driven by one engine thread. ``end_turn`` returns at once; tool calls run
in `IsolatedPool` worker processes and the future is completed from the pool's dispatcher thread
(the session's state is guarded by a lock). Environment calls (``step``, a tool environment's methods) run
in ``end_turn``, one at a time under ``timeout_s`` (see `torchrlhf.agents.env`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrlhf.agents.agent import Agent
from torchrlhf.agents.env import (
    Environment,
    call_in_thread,
    call_with_timeout,
    check_reset,
    check_reward,
    check_step,
    tool_env_observation,
)
from torchrlhf.agents.parsing import CallError, ToolCall
from torchrlhf.agents.render import ChatRenderer, TokenCheck, row_messages
from torchrlhf.generation.session import TurnResult
from torchrlhf.utils.isolated import CallTimeout

log = logging.getLogger(__name__)

Message = dict[str, Any]

COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "env_errors", "observation_tokens", "truncated_observations")
# A rollout batch's per-trajectory agent columns (`agent_columns`): ``Trajectory.metrics`` (the turns, the
# `COUNTS`, ``token_mismatches`` with ``check_tokens``, ``harness_splits`` with a harness), the environment's
# (or harness's) reward, 1 where an error ended it.
AGENT_COLUMNS = ("num_turns", *COUNTS, "token_mismatches", "harness_splits", "env_reward", "agent_error")


class TokenMismatchError(ValueError):
    """``check_tokens: error``: re-rendering the conversation from text gives other tokens."""


@dataclass
class Trajectory:
    """A finished multi-turn trajectory, token-exact.

    ``response_tokens`` are everything after the prompt: the model's sampled turns and the rendered
    observation deltas; ``loss_mask`` is 1 on model tokens, 0 on observation tokens.
    """

    prompt_tokens: list[int]
    response_tokens: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # model turns, [start, end) in response_tokens
    turn_rewards: list[float] = field(default_factory=list)  # per model turn (environment reward)
    finish_reason: str = ""  # stop | env_done | length | max_turns | budget | error
    error: bool = False  # ended by on_error='end' (or a failed env.reset): scores on_error_score
    final_text: str = ""  # the last model turn, decoded without special tokens: what a reward function grades
    metrics: dict[str, float] = field(default_factory=dict)
    token_check: TokenCheck | None = None

    @property
    def env_reward(self) -> float:
        return float(sum(self.turn_rewards))


class AgentSession:
    """One trajectory's state: the conversation, its tokens, budgets and counters. Made by `Agent.session`."""

    def __init__(
        self,
        agent: Agent,
        row: Mapping[str, Any],
        prompt_messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self._agent = agent
        self._renderer: ChatRenderer = agent.renderer
        self._lock = threading.RLock()  # re-entered when a tool future is already done
        self._pending: Future | None = None
        self.row = row
        self.env: Environment | None = None
        self._counts = dict.fromkeys(COUNTS, 0)
        self.done = False
        messages = [dict(m) for m in (prompt_messages if prompt_messages is not None else row_messages(row))]
        reset_error = None
        if agent.env_factory is not None:
            timeout = agent.spec.timeout_s
            try:
                self.env = call_with_timeout(agent.env_factory, timeout)
                if agent.tool_env:
                    first = check_reset(call_with_timeout(self.env.reset, timeout, **row), tool_env=True)
                else:
                    first = check_reset(call_with_timeout(self.env.reset, timeout, row), tool_env=False)
                if isinstance(first, str):
                    messages.append({"role": "user", "content": first})
                elif first is not None:
                    messages = [dict(m) for m in first]
            except Exception as e:  # noqa: BLE001 - a bad environment is counted, never stops the run
                reset_error = e
        if not messages:
            if reset_error is None:
                raise ValueError("AgentSession: the row has no prompt and the environment gave no first observation")
            messages = [{"role": "user", "content": ""}]  # the trajectory ends before any turn; it needs a prompt
        self.messages: list[Message] = messages
        self.prompt_tokens: list[int] = self._renderer.prompt_tokens(messages)
        self.trajectory = Trajectory(prompt_tokens=list(self.prompt_tokens))
        self._model_tokens = 0
        # A row may carry its own, smaller response budget (as single-turn prompts may).
        self._max_tokens = min(agent.max_tokens, int(row.get("max_tokens") or agent.max_tokens))
        if reset_error is not None:
            self._counts["env_errors"] += 1
            _log_failure("environment reset", reset_error)
            self._finish("error", error=True)
        elif self._budget() <= 0:
            self._finish("budget")

    # ------------------------------------------------------------------ engine interface
    @property
    def tokens(self) -> list[int]:
        """The whole trajectory so far: prompt + response."""
        return self.prompt_tokens + self.trajectory.response_tokens

    def turn_budget(self) -> int:
        """Most model tokens the next turn may sample; 0 when the trajectory is done or a turn is pending."""
        with self._lock:
            return 0 if self.done or self._pending is not None else max(0, self._budget())

    def end_turn(self, tokens: Sequence[int], finish_reason: str) -> Future:
        """Record a model turn (its sampled tokens, ending with the end-of-turn token when it stopped).

        ``finish_reason``: ``"stop"`` (the model ended its turn) or ``"length"`` (it ran out of
        budget: the trajectory ends). Returns a future of `TurnResult`, resolved once the turn's
        tool calls finished (at once for environment turns and final answers).
        """
        with self._lock:
            if self.done or self._pending is not None:
                raise RuntimeError("end_turn: the trajectory is done or its last turn is still pending")
            if finish_reason not in ("stop", "length"):
                raise ValueError(f"end_turn: finish_reason must be 'stop' or 'length', got {finish_reason!r}")
            tokens = [int(t) for t in tokens]
            if not tokens or len(tokens) > self._budget():
                raise ValueError(f"end_turn: a turn has 1 to turn_budget()={self._budget()} tokens, got {len(tokens)}")
            traj = self.trajectory
            start = len(traj.response_tokens)
            traj.response_tokens.extend(tokens)
            traj.loss_mask.extend([1] * len(tokens))
            traj.turn_spans.append((start, start + len(tokens)))
            traj.turn_rewards.append(0.0)
            self._model_tokens += len(tokens)
            text = self._renderer.tokenizer.decode(tokens, skip_special_tokens=True)
            traj.final_text = text
            self.messages.append({"role": "assistant", "content": self._renderer.turn_content(tokens)})
            self._last_turn = tokens
            future: Future = Future()
            if finish_reason != "stop":
                return self._resolved(future, self._finish("length", unseen_turn=text))
            calls = self._agent.parser.parse(text) if self._agent.parser is not None else []
            if calls:
                if len(traj.turn_spans) >= self._agent.spec.max_turns:
                    return self._resolved(future, self._finish("max_turns", unseen_turn=text))
                self._pending = future
                self._run_tools(calls, future)
                return future
            if self.env is None or self._agent.tool_env:  # a tool environment acts through its methods only
                return self._resolved(future, self._finish("stop"))
            try:
                observation, reward, env_done = check_step(call_with_timeout(self.env.step, self._agent.spec.timeout_s,
                                                                             text))
            except Exception as e:  # noqa: BLE001
                self._counts["env_errors"] += 1
                _log_failure("environment step", e)
                if self._agent.spec.on_error == "end" or isinstance(e, CallTimeout):  # a hung env is still busy
                    return self._resolved(future, self._finish("error", error=True))
                observation, reward, env_done = f"Error: the environment failed: {_describe(e)}", 0.0, False
            traj.turn_rewards[-1] = reward
            if env_done or observation is None:
                return self._resolved(future, self._finish("env_done", reward))
            if len(traj.turn_spans) >= self._agent.spec.max_turns:
                return self._resolved(future, self._finish("max_turns", reward))
            return self._resolved(future, self._observe([(None, observation)], reward))

    def result(self) -> Trajectory:
        """The finished trajectory (with its metrics and, in check mode, the token check)."""
        with self._lock:
            if not self.done:
                raise RuntimeError("result: the trajectory is not done (turn_budget() > 0 or a turn is pending)")
            traj = self.trajectory
            if traj.metrics:
                return traj
            mode = self._agent.spec.check_tokens
            metrics = {"num_turns": float(len(traj.turn_spans)), **{k: float(v) for k, v in self._counts.items()}}
            if mode != "off":
                traj.token_check = self._renderer.check(self.messages, self.tokens)
                metrics["token_mismatches"] = float(traj.token_check.mismatches)
                if mode == "error" and traj.token_check.mismatches:
                    raise TokenMismatchError(self._describe_mismatch(traj.token_check))
            traj.metrics = metrics
            return traj

    def final_reward(self, reward_fn_score: float | None = None) -> float:
        """The trajectory's score by the spec's ``reward`` rule; ``on_error_score`` when it ended in error."""
        spec = self._agent.spec
        if self.trajectory.error:
            return spec.on_error_score
        if spec.reward in ("reward_fn", "sum") and reward_fn_score is None:
            raise ValueError(f"final_reward: reward={spec.reward!r} needs the reward function's score")
        env = self.trajectory.env_reward
        return {"env": env, "reward_fn": reward_fn_score, "sum": env + (reward_fn_score or 0.0)}[spec.reward]

    # ------------------------------------------------------------------ internals
    def _budget(self) -> int:
        left = self._max_tokens - self._model_tokens
        if self._agent.max_trajectory_tokens is not None:
            left = min(left, self._agent.max_trajectory_tokens - len(self.prompt_tokens)
                       - len(self.trajectory.response_tokens))
        return left

    def _run_tools(self, calls: list[ToolCall | CallError], future: Future) -> None:
        spec, tools = self._agent.spec, self._agent.tools
        limit = spec.tool_calls.max_parallel
        outcomes: list[Future | CallError] = []
        env_calls: list[Future | CallError] = []  # this turn's calls of the environment's methods, finished
        for i, call in enumerate(calls):
            if isinstance(call, ToolCall) and i >= limit:
                call = CallError(call.name, f"not run: at most {limit} tool calls per turn")
            if isinstance(call, CallError):
                outcomes.append(call)
            elif call.name in self._agent.env_tools:
                outcomes.append(self._call_env_method(call, env_calls))
                env_calls.append(outcomes[-1])
            else:
                outcomes.append(self._agent.executor.submit(tools[call.name], call.arguments))
        names = [c.name for c in calls]
        self._counts["tool_calls"] += len(calls)
        remaining = [f for f in outcomes if isinstance(f, Future)]
        if not remaining:
            self._complete_tools(names, outcomes, future)
            return
        counter = {"left": len(remaining)}
        counter_lock = threading.Lock()

        def one_done(_: Future) -> None:
            with counter_lock:
                counter["left"] -= 1
                last = counter["left"] == 0
            if last:
                with self._lock:
                    self._complete_tools(names, outcomes, future)

        for f in remaining:
            f.add_done_callback(one_done)

    def _call_env_method(self, call: ToolCall, earlier: list[Future | CallError]) -> Future | CallError:
        """A tool environment's method on this trajectory's env, run now (the turn's calls one at a time, in
        order, as the env's state requires); its finished future. Not run after an earlier call timed out."""
        if any(isinstance(f, Future) and isinstance(f.exception(), CallTimeout) for f in earlier):
            return CallError(call.name, "not run: the environment is still busy with a call that timed out")
        method = getattr(self.env, call.name)
        future = call_in_thread(lambda: tool_env_observation(method(**call.arguments)), self._agent.spec.timeout_s)
        future.exception()  # wait: done, or timed out
        return future

    def _complete_tools(self, names: list[str | None], outcomes: list[Future | CallError], future: Future) -> None:
        """Turn the calls' outcomes into an observation and resolve ``future`` (caller holds the lock)."""
        try:
            results, failed, env_hung = [], False, False
            for name, outcome in zip(names, outcomes):
                content, error = _tool_outcome(name, outcome, self._agent.spec.timeout_s)
                if error:
                    failed = True
                    self._counts["tool_timeouts" if error == "timeout" else "tool_errors"] += 1
                    env_hung |= error == "timeout" and name in self._agent.env_tools  # the env is still busy
                results.append((name, content))
            self._pending = None
            if failed and (self._agent.spec.on_error == "end" or env_hung):
                result = self._finish("error", error=True)
            else:
                result = self._observe(results, 0.0)
            future.set_result(result)
        except Exception as e:  # noqa: BLE001 - never leave the engine waiting on a future
            self._pending = None
            self._finish("error", error=True)
            future.set_exception(e)

    def _observe(self, results: list[tuple[str | None, str]], reward: float) -> TurnResult:
        renderer = self._renderer
        messages, truncated = renderer.observation_messages(results)
        delta = renderer.delta_tokens(self._last_turn, messages)
        traj = self.trajectory
        room = self._max_tokens - self._model_tokens
        if self._agent.max_trajectory_tokens is not None:
            room = min(room, self._agent.max_trajectory_tokens - len(self.prompt_tokens)
                       - len(traj.response_tokens) - len(delta))
        self._counts["truncated_observations"] += truncated
        if room < 1:  # the observation and at least one more model token do not fit
            return self._finish("budget", reward)
        traj.response_tokens.extend(delta)
        traj.loss_mask.extend([0] * len(delta))
        self._counts["observation_tokens"] += len(delta)
        self.messages.extend(messages)
        return TurnResult(observation_tokens=delta, reward=reward)

    def _finish(self, reason: str, reward: float = 0.0, *, error: bool = False,
                unseen_turn: str | None = None) -> TurnResult:
        """End the trajectory. The environment scores the episode once: a tool environment's ``get_reward``, or,
        when the session ended a step environment's episode first (``length``, ``budget``, ``max_turns``), its
        ``end_episode(unseen_turn)``, ``unseen_turn`` being the last model turn when ``step`` never got it."""
        self.done = True
        self._pending = None
        traj = self.trajectory
        if self._agent.tool_env:
            score, args = getattr(self.env, "get_reward", None), ()
        elif reason in ("length", "budget", "max_turns"):
            score, args = getattr(self.env, "end_episode", None), (unseen_turn,)
        else:
            score, args = None, ()
        if score is not None and not error:
            try:
                end_reward = check_reward(call_with_timeout(score, self._agent.spec.timeout_s, *args), score.__name__)
                if traj.turn_rewards:  # with no model turn there is nothing to credit
                    traj.turn_rewards[-1] += end_reward
                reward = traj.turn_rewards[-1] if traj.turn_rewards else end_reward
            except Exception as e:  # noqa: BLE001 - counted; the trajectory scores on_error_score
                self._counts["env_errors"] += 1
                _log_failure(f"environment {score.__name__}", e)
                reason, error = "error", True
        traj.finish_reason = reason
        traj.error = error
        close = getattr(self.env, "close", None)  # a session's end frees what its environment holds (a socket)
        if callable(close):
            try:
                call_with_timeout(close, self._agent.spec.timeout_s)
            except Exception as e:  # noqa: BLE001 - the trajectory is complete either way
                _log_failure("environment close", e)
        return TurnResult(observation_tokens=None, reward=reward)

    @staticmethod
    def _resolved(future: Future, result: TurnResult) -> Future:
        future.set_result(result)
        return future

    def _describe_mismatch(self, check: TokenCheck) -> str:
        i = check.first_mismatch or 0
        decode = self._renderer.tokenizer.decode
        return (f"re-rendering the conversation from text differs from the trajectory's tokens at {check.mismatches} "
                f"position(s), first at token {i}: trajectory {decode(self.tokens[max(0, i - 3): i + 3])!r}")


def agent_columns(trajectories: Sequence[Trajectory]) -> dict[str, torch.Tensor]:
    """The `AGENT_COLUMNS` of finished trajectories (those they have: ``token_mismatches`` only when checked)
    as float columns, one row per trajectory."""
    values = [{**t.metrics, "env_reward": t.env_reward, "agent_error": float(t.error)} for t in trajectories]
    return {k: torch.tensor([v[k] for v in values], dtype=torch.float32) for k in AGENT_COLUMNS if k in values[0]}


def _tool_outcome(name: str | None, outcome: Future | CallError, timeout_s: float) -> tuple[str, str | None]:
    """(observation text, None | 'error' | 'timeout') for one call."""
    if isinstance(outcome, CallError):
        return f"Error: {outcome.message}", "error"
    exc = outcome.exception()
    if isinstance(exc, CallTimeout):
        return f"Error: tool {name!r} timed out after {timeout_s:g}s", "timeout"
    if exc is not None:
        _log_failure(f"tool {name!r}", exc)
        return f"Error: tool {name!r} failed: {_describe(exc)}", "error"
    value = outcome.result()
    if not isinstance(value, str):
        return f"Error: tool {name!r} returned {type(value).__name__}, not a string", "error"
    return value, None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


_failures_logged = {"n": 0}


def _log_failure(what: str, exc: BaseException) -> None:
    if _failures_logged["n"] < 3:  # counted in the metrics; a few are logged so a broken tool is visible
        _failures_logged["n"] += 1
        log.warning("%s failed: %s", what, _describe(exc))
