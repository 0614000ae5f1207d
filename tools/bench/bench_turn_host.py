"""The host's time per agent turn: what `AgentSession.end_turn` costs the engine's loop, with no model.

When a turn ends, the engine's loop calls the session, which decodes the turn, runs the environment's
``step`` (in a thread, under the spec's timeout), renders the observation with the chat template and
tokenizes it. On a GPU the decode steps are short, so this host time is part of every ended turn.
Sessions over `bench_agent.NotesEnv` (an environment that answers at once), SmolLM2's tokenizer and chat
template, ``--trajectories`` sessions of ``--turns`` turns of 25 tokens; median of ``--repeats``.

    python tools/bench/bench_turn_host.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_agent import _rows  # noqa: E402

from torchrlhf.agents import AgentSession, build_agent  # noqa: E402
from torchrlhf.models import load_tokenizer, smollm2_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok = load_tokenizer(str(smollm2_model_dir()))
    spec = {"env": {"_component_": "bench_agent:NotesEnv", "turns": args.turns + 1}, "reward": "env",
            "max_turns": args.turns + 1}
    agent = build_agent(spec, tok, max_tokens=100_000, max_trajectory_tokens=100_000)
    rows = _rows(args.trajectories)
    turn = tok.encode("Then you might eat one, leaving four apples and some more fruit for later on today.")[:24]
    turn.append(tok.convert_tokens_to_ids("<|im_end|>"))
    create, end = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        sessions = [AgentSession(agent, r) for r in rows]
        create.append((time.perf_counter() - start) / len(rows))
        start = time.perf_counter()
        for _ in range(args.turns):
            for s in sessions:
                s.end_turn(turn, "stop").result()
        end.append((time.perf_counter() - start) / (args.turns * len(rows)))
    print(f"{args.trajectories} sessions x {args.turns} turns of {len(turn)} tokens, median of {args.repeats}: "
          f"session start {statistics.median(create) * 1e3:.2f} ms, end_turn {statistics.median(end) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
