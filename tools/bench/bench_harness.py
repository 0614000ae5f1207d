"""The OpenAI-endpoint harness path against the native agent session, on the same task: time per trajectory.

The calculator task of ``recipes/configs/grpo_calculator_agent_cpu.yaml`` on SmolLM2-135M-Instruct, greedy
(so both sides generate the same turns, up to float rounding), ``--trajectories`` test prompts, one engine:

- ``native``: `NativeEngine.generate(..., sessions=...)` with the recipe's agent (``<calc>`` tags, the
  calculator tool in a worker process): slots keep their KV cache between turns.
- ``harness``: ``recipes/harness/calculator_agent.py`` (an ``openai`` client loop, one thread per
  trajectory) through `torchrlhf.agents.harness.HarnessRunner`: each trajectory's calls are one agent session
  of the engine's ``generate`` (its slot parked between calls, only the new tokens computed; ``--engine vllm``:
  both sides run their sessions in rounds, vLLM's prefix cache sparing the re-prefill).

Sides alternate, ``--repeats`` times each (medians printed), so both see the same load on a shared host.

    python tools/bench/bench_harness.py --trajectories 16 --repeats 4
    python tools/bench/bench_harness.py --trajectories 16 --repeats 2 --engine vllm
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from torchrlhf.agents import AgentSession, build_agent
from torchrlhf.agents.harness import HarnessRunner
from torchrlhf.generation.base import sample_sessions
from torchrlhf.config import load_callable
from torchrlhf.data import Batch
from torchrlhf.generation import NativeEngine, SamplingParams, VLLMEngine
from torchrlhf.models import load_tokenizer, smollm2_model_dir
from torchrlhf.rewards.calculator import compute_score

ROOT = Path(__file__).resolve().parents[2]
NATIVE = {"tools": ["calculator"], "tool_calls": {"format": "tags", "tags": {"calc": "calculator"}}, "max_turns": 3,
          "max_tool_response_tokens": 32, "reward": "reward_fn"}
HARNESS = {"harness": {"fn": str(ROOT / "recipes/harness/calculator_agent.py") + ":run_agent"}, "reward": "env"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", choices=("native", "vllm"), default="native",
                        help="vllm: both sides on VLLMEngine, whose prefix cache spares the harness's re-prefill")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = str(smollm2_model_dir())
    tok = load_tokenizer(model)
    lines = (ROOT / "recipes/data/calculator_test.jsonl").read_text().splitlines()[: args.trajectories]
    rows = [json.loads(line) for line in lines]
    engine_cls = NativeEngine if args.engine == "native" else VLLMEngine
    engine = engine_cls(model, tokenizer=tok, max_batch_size=64, max_seq_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=True)
    native = build_agent(NATIVE, tok, max_tokens=args.max_tokens, max_trajectory_tokens=320)
    harness_agent = build_agent(HARNESS, tok, max_tokens=args.max_tokens, max_trajectory_tokens=320)
    runner = HarnessRunner(harness_agent, load_callable(HARNESS["harness"]["fn"]))

    def run_native() -> tuple[float, int, float]:
        sessions = [AgentSession(native, row) for row in rows]
        batch = Batch({"input_ids": torch.ones(len(rows), 1, dtype=torch.long),
                       "attention_mask": torch.ones(len(rows), 1, dtype=torch.long)})
        start = time.perf_counter()
        engine.generate(batch, params, sessions=sessions)
        seconds = time.perf_counter() - start
        trajs = [s.result() for s in sessions]
        acc = statistics.mean(compute_score(t.final_text, r["ground_truth"]) for t, r in zip(trajs, rows))
        return seconds, sum(sum(t.loss_mask) for t in trajs), acc

    def run_harness() -> tuple[float, int, float]:
        start = time.perf_counter()
        trajs, _ = runner.run(rows, list(range(len(rows))), functools.partial(sample_sessions, engine.generate, params))
        seconds = time.perf_counter() - start
        return seconds, sum(sum(t.loss_mask) for t in trajs), statistics.mean(t.env_reward for t in trajs)

    run_native(), run_harness()  # warm-up
    print("warm-up done", flush=True)
    results: dict[str, list[tuple[float, int, float]]] = {"native": [], "harness": []}
    for _ in range(args.repeats):
        for side, run in (("native", run_native), ("harness", run_harness)):
            results[side].append(run())
            print(f"  {side}: {results[side][-1][0]:.2f}s", flush=True)
    runner.close()
    native.close()
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    per_traj = {}
    for side, runs in results.items():
        per_traj[side] = statistics.median(s for s, _, _ in runs) / len(rows)
        print(f"{side:8s} {per_traj[side] * 1e3:8.1f} ms/trajectory  model tokens {runs[-1][1]:5d}  "
              f"accuracy {runs[-1][2]:.3f}  (runs: {', '.join(f'{s:.2f}s' for s, _, _ in runs)})")
    print(f"harness / native time per trajectory: {per_traj['harness'] / per_traj['native']:.2f}x "
          f"({len(rows)} trajectories, max_tokens {args.max_tokens}, {args.threads} threads, {args.engine} engine)")


if __name__ == "__main__":
    main()
