"""The contract between an engine and the multi-turn sessions it drives (``generate(..., sessions=)``).

An engine samples tokens; a `Session` decides what follows each model turn. The agents' `AgentSession`
(`torchrlhf.agents.session`) and the OpenAI-endpoint harness's segment (`torchrlhf.agents.harness`) implement it,
so one engine serves both::

    tokens = session.tokens                          # the whole context so far
    while (budget := session.turn_budget()) > 0:     # 0: done, or a turn is pending
        turn = <sample up to `budget` tokens after `tokens`, stopping at the end-of-turn token>
        result = session.end_turn(turn, "stop" | "length").result()   # a Future: poll it between decode steps
        if result.done: break
        tokens += turn + result.observation_tokens   # prefill only these
    trajectory = session.result()

`run_rounds` drives sessions with any sampler of single turns, one batched call per round (how an engine without
sessions of its own, vLLM, runs them: `torchrlhf.generation.base.generate_in_rounds`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Protocol

Turn = tuple[list[int], list[float], str]  # sampled tokens, their log-probs (zeros when not asked), "stop" | "length"
TurnSampler = Callable[[list[int], int], list[Turn]]


@dataclass(frozen=True)
class TurnResult:
    """What follows a model turn: observation tokens to append, or None when the trajectory is done."""

    observation_tokens: list[int] | None
    reward: float = 0.0  # this turn's environment reward

    @property
    def done(self) -> bool:
        return self.observation_tokens is None


class SessionTrajectory(Protocol):
    """What an engine reads of a finished session (`assemble_trajectories`)."""

    prompt_tokens: list[int]
    response_tokens: list[int]  # model turns and observations, in order
    loss_mask: list[int]  # 1 on model tokens, 0 on observation tokens
    finish_reason: str


class Session(Protocol):
    """One trajectory an engine drives turn by turn (see the module docstring for the order of calls)."""

    prompt_tokens: list[int]

    @property
    def tokens(self) -> list[int]:
        """The whole context of the next turn: prompt, model turns and observations so far."""

    def turn_budget(self) -> int:
        """Most tokens the next turn may sample; 0 when the trajectory is done or its last turn is pending."""

    def end_turn(self, tokens: Sequence[int], finish_reason: str) -> Future[TurnResult]:
        """Record a sampled turn (``"stop"``: it ended with the end-of-turn token; ``"length"``: its budget ran
        out); the future resolves once what follows it (tools, the environment, the harness's next call) is known."""

    def result(self) -> SessionTrajectory:
        """The finished trajectory (only once ``turn_budget()`` is 0 with no turn pending)."""


def run_rounds(sessions: Sequence[Session], sample_turns: TurnSampler) -> list[list[float]]:
    """Drive ``sessions`` to their ends; each session's model-token log-probs, in order.

    ``sample_turns(live, round)`` samples the next turn of each session index in ``live`` after its ``tokens``, at
    most its ``turn_budget()`` tokens, and returns them in ``live``'s order. Each round waits until every turn's
    tools and environment step are done, then starts the next.
    """
    logps: list[list[float]] = [[] for _ in sessions]
    round_ = 0
    while live := [k for k, s in enumerate(sessions) if s.turn_budget() > 0]:
        futures = []
        for k, (tokens, turn_logps, reason) in zip(live, sample_turns(live, round_), strict=True):
            logps[k].extend(turn_logps)
            futures.append(sessions[k].end_turn(tokens, reason))
        wait(futures)
        round_ += 1
    return logps
