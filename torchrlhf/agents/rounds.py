"""The round-based agent driver: multi-turn trajectories from a sampler of single turns.

Each round samples one turn for every session that can still generate, together (one batched call), hands
each turn to its session (`AgentSession.end_turn`), waits until every tool call and environment step of the
round is done, and starts the next round. Any engine whose `generate` samples single turns gets multi-turn
support this way (`torchrlhf.generation.base.generate_in_rounds` is the adapter; `VLLMEngine` uses it). An
engine that keeps a trajectory's KV cache while its tools run does better: the native engine parks the
slot and keeps decoding the others (`torchrlhf.generation.engine`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import wait

from torchrlhf.agents.session import AgentSession

Turn = tuple[list[int], list[float], str]  # sampled tokens, their log-probs (zeros when not asked), "stop" | "length"
TurnSampler = Callable[[list[int], int], list[Turn]]


def run_rounds(sessions: Sequence[AgentSession], sample_turns: TurnSampler) -> list[list[float]]:
    """Drive ``sessions`` to their ends; each session's model-token log-probs, in order.

    ``sample_turns(live, round)`` samples the next turn of each session index in ``live`` after its
    ``tokens``, at most its ``turn_budget()`` tokens, and returns them in ``live``'s order.
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
