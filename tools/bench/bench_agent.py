"""Multi-turn agent rollouts: cache reuse vs re-prefilling every turn, the native engine and vLLM.

A fixed workload on SmolLM2-135M-Instruct: ``--trajectories`` trajectories (``--n`` samples of each prompt)
of up to ``--turns`` model turns; after each turn a small environment answers with a short observation
(``Turn k noted. Continue.``), and the prompt carries a few-shot conversation, as agent prompts do. Greedy,
so every side generates the same tokens (up to float rounding). Sides, one after the other in this
process, ``--repeats`` times each (the median is printed):

- ``native``: `NativeEngine.generate(..., sessions=...)`: one continuous-batching loop; a trajectory's
  keys/values stay in its slot between turns and only ``[last token] + observation`` is prefilled.
- ``native-reprefill``: the same engine driven in rounds, every turn a new request with the whole
  conversation so far (what an agent loop without cache reuse does).
- ``vllm`` / ``vllm-reprefill`` (``--vllm``): `VLLMEngine`'s round loop with prefix caching on / off.

- ``native-single``: the same engine, single-turn: every sample decodes the trajectories' mean model tokens
  in one turn (EOS ignored): the speed a multi-turn run is measured against (issue target: ``native`` >= 0.7x).

Prints seconds per trajectory, model tokens per second, prefill tokens per trajectory, and the ratios
(re-prefill / reuse, agent / single-turn, native / vLLM).

    python tools/bench/bench_agent.py --threads 2
    python tools/bench/bench_agent.py --threads 2 --vllm

On a GPU, with a random-weight model (e.g. the GPU kit's ``mkmodels.py`` output, which carries SmolLM2's
tokenizer): random weights never end a turn, so ``--stop-every K`` makes every K-th token id a stop id and
samples at temperature 1 (turns of about K tokens):

    python tools/bench/bench_agent.py --model /tmp/models/smol --device cuda --dtype bfloat16 \
        --trajectories 64 --n 1 --stop-every 25 --max-tokens 256
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from concurrent.futures import wait
from typing import Any

import torch

from torchrlhf.agents import AgentSession, build_agent
from torchrlhf.data import Batch
from torchrlhf.generation import NativeEngine, SamplingParams, VLLMEngine  # VLLMEngine imports vLLM when built
from torchrlhf.models import load_tokenizer, smollm2_model_dir

SYSTEM = "You are a careful assistant. Keep every reply short: one sentence."
FEW_SHOT = [
    {"role": "user", "content": "We will count fruit together. I have 3 apples and buy 2 more. How many now?"},
    {"role": "assistant", "content": "You have 5 apples now."},
    {"role": "user", "content": "Turn 1 noted. Continue."},
    {"role": "assistant", "content": "Then you might eat one, leaving 4."},
]
QUESTIONS = [
    "Let us plan a picnic step by step. What should we pack first?",
    "We are writing a story about a fox. How does it begin?",
    "Help me sort my books. Where do we start?",
    "We are cooking soup. What is the first ingredient?",
    "Let us plan a trip to the mountains. What comes first?",
    "We are building a birdhouse. What do we need first?",
    "Teach me a card game. What is the first rule?",
    "Let us tidy the garden. Which task comes first?",
]


class NotesEnv:
    """Answers every turn with a short note; done after ``turns`` model turns."""

    def __init__(self, turns: int = 4) -> None:
        self.turns = turns

    def reset(self, row: dict[str, Any]) -> None:
        self.k = 0

    def step(self, text: str) -> tuple[str | None, float, bool]:
        self.k += 1
        return f"Turn {self.k} noted. Continue.", 0.0, self.k >= self.turns


def _rows(count: int) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM}, *FEW_SHOT]
    return [{"prompt": [*messages, {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]} for i in range(count)]


def _prompt_batch(rows: list[dict[str, Any]]) -> Batch:
    return Batch({"input_ids": torch.ones(len(rows), 1, dtype=torch.long),
                  "attention_mask": torch.ones(len(rows), 1, dtype=torch.long)}, {"row": list(range(len(rows)))})


def reprefill_rounds(engine: NativeEngine, sessions: list[Any], params: SamplingParams) -> None:
    """Drive sessions in rounds, every turn prefilling the whole conversation (no cache between turns)."""
    while True:
        active = [s for s in sessions if s.turn_budget() > 0]
        if not active:
            return
        width = max(len(s.tokens) for s in active)
        ids = torch.full((len(active), width), engine.pad_id(), dtype=torch.long)
        mask = torch.zeros(len(active), width, dtype=torch.long)
        for i, s in enumerate(active):
            ids[i, width - len(s.tokens):] = torch.tensor(s.tokens)
            mask[i, width - len(s.tokens):] = 1
        budgets = torch.tensor([s.turn_budget() for s in active])
        batch = Batch({"input_ids": ids, "attention_mask": mask, "max_tokens": budgets})
        out = engine.generate(batch, SamplingParams(n=1, temperature=0.0, max_tokens=params.max_tokens,
                                                    stop_token_ids=params.stop_token_ids))
        futures = []
        for i, s in enumerate(active):
            k = int(out["response_mask"][i].sum())
            futures.append(s.end_turn(out["responses"][i, :k].tolist(), out["finish_reason"][i]))
        wait(futures)


def prefill_tokens(trajectories: list[Any], reuse: bool) -> float:
    """Tokens each trajectory sends through a prefill: reusing the cache, the prompt once and then
    ``[last token] + observation`` per turn; re-prefilling, the whole conversation every turn."""
    total = 0
    for t in trajectories:
        spans = t.turn_spans
        if reuse:
            total += len(t.prompt_tokens) + sum(1 + (b[0] - a[1]) for a, b in zip(spans, spans[1:]))
        else:
            total += sum(len(t.prompt_tokens) + start for start, _ in spans)
    return total / len(trajectories)


def _single_turn(engine: NativeEngine, agent: Any, rows: list[dict[str, Any]], n: int, tokens: int):
    """The rows' first contexts (as the agent renders them) as one single-turn request of ``tokens`` new
    tokens per sample, EOS ignored."""
    ids = [AgentSession(agent, r).prompt_tokens for r in rows]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), engine.pad_id(), dtype=torch.long)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x):] = torch.tensor(x)
        mask[i, width - len(x):] = 1
    return (Batch({"input_ids": input_ids, "attention_mask": mask}),
            SamplingParams(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=16)
    ap.add_argument("--n", type=int, default=2, help="samples per prompt (they share the prompt's prefill)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=160, help="model tokens per trajectory, over all turns")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--vllm", action="store_true", help="also vLLM (prefix caching on and off)")
    ap.add_argument("--model", default=None, help="an HF model dir with a tokenizer (default: SmolLM2-135M)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--compile", action="store_true", help="the native engine's compiled decode step")
    ap.add_argument("--stop-every", type=int, default=0,
                    help="random weights: every K-th token id ends a turn, sampled at temperature 1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or str(smollm2_model_dir())
    tok = load_tokenizer(path)
    spec = {"env": {"_component_": f"{__file__}:NotesEnv", "turns": args.turns}, "reward": "env",
            "max_turns": args.turns}
    rows = _rows(args.trajectories // args.n)
    stops = list(range(args.stop_every - 1, len(tok), args.stop_every)) if args.stop_every else []
    params = SamplingParams(n=args.n, temperature=1.0 if stops else 0.0, max_tokens=args.max_tokens,
                            stop_token_ids=stops, seed=0)
    seq = 1024
    agent = build_agent(spec, tok, max_tokens=args.max_tokens, max_trajectory_tokens=seq)
    sessions = lambda: [AgentSession(agent, r) for r in rows for _ in range(args.n)]  # noqa: E731

    sides: dict[str, Any] = {}
    # No prefix cache: ``native-reprefill`` must compute every turn's whole conversation, and the repeats of
    # ``native-single`` sample the same prompts (an RL step loads new weights first, so none carries over).
    native = NativeEngine(path, max_batch_size=args.trajectories, max_seq_len=seq, device=args.device,
                          dtype=getattr(torch, args.dtype), prefix_cache=False, compile=args.compile)
    sides["native"] = (True, lambda s: native.generate(_prompt_batch(rows), params, sessions=s))
    if not stops:  # re-prefilling is driven greedily: comparable only where greedy turns end by themselves
        sides["native-reprefill"] = (False, lambda s: reprefill_rounds(native, s, params))
    if args.vllm:
        engines = {reuse: VLLMEngine(path, max_batch_size=args.trajectories, max_seq_len=seq,
                                     enable_prefix_caching=reuse) for reuse in (True, False)}
        sides["vllm"] = (True, lambda s: engines[True].generate(_prompt_batch(rows), params, sessions=s))
        sides["vllm-reprefill"] = (False, lambda s: engines[False].generate(_prompt_batch(rows), params, sessions=s))

    results: dict[str, dict[str, float]] = {}
    steps: dict[str, float] = {}
    for name, (reuse, run) in sides.items():
        run(sessions())  # warm-up
        times, trajs = [], []
        for _ in range(args.repeats):
            batch = sessions()
            start = time.perf_counter()
            out = run(batch)
            times.append(time.perf_counter() - start)
            trajs = [s.result() for s in batch]
            if name == "native":
                steps = {k.split("/")[1]: v for k, v in out.meta.items() if k.startswith("rollout/")}
        seconds = statistics.median(times)
        model_tokens = sum(sum(t.loss_mask) for t in trajs)
        results[name] = {"s/traj": seconds / len(trajs), "tok/s": model_tokens / seconds,
                         "turns": sum(len(t.turn_spans) for t in trajs) / len(trajs),
                         "prefill/traj": prefill_tokens(trajs, reuse), "model/traj": model_tokens / len(trajs)}
    # Single-turn at the same batch: every sample decodes the agent trajectories' mean model tokens at once.
    single_tokens = max(1, round(results["native"]["model/traj"]))
    first = native.generate(*_single_turn(native, agent, rows, args.n, single_tokens))
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        first = native.generate(*_single_turn(native, agent, rows, args.n, single_tokens))
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    results["native-single"] = {"s/traj": seconds / len(first), "tok/s": int(first["response_mask"].sum()) / seconds,
                                "turns": 1.0, "prefill/traj": first["prompts"].shape[1], "model/traj": single_tokens}
    where = f"{args.threads} threads" if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    print(f"{args.trajectories} trajectories (n={args.n}), up to {args.turns} turns, "
          f"{'sampled, turns end at stop ids every ' + str(args.stop_every) if stops else 'greedy'}, "
          f"{Path(path).name} {args.dtype}, {where}, median of {args.repeats}")
    print(f"{'side':<18}{'s/traj':>9}{'tok/s':>9}{'turns':>7}{'model tok':>11}{'prefill tok':>13}")
    for name, r in results.items():
        print(f"{name:<18}{r['s/traj']:>9.3f}{r['tok/s']:>9.1f}{r['turns']:>7.2f}{r['model/traj']:>11.1f}"
              f"{r['prefill/traj']:>13.1f}")
    if "native-reprefill" in results:
        print(f"native: re-prefill / reuse = "
              f"{results['native-reprefill']['s/traj'] / results['native']['s/traj']:.2f}x (time per trajectory)")
    if steps:  # the last native run's steps: riding ones are eager where the plain step is compiled or graphed
        print(f"decode steps of the last native run: {steps['decode_steps']:.0f} decode, {steps['riding_steps']:.0f} of them "
              f"riding observations, {steps['extends']:.0f} extends of their own; single-turn: "
              f"{first.meta['rollout/decode_steps']:.0f} decode")
    print(f"native: agent / single-turn = {results['native']['tok/s'] / results['native-single']['tok/s']:.2f}x "
          "(model tokens per second)")
    if args.vllm:
        print(f"vllm: re-prefill / reuse = {results['vllm-reprefill']['s/traj'] / results['vllm']['s/traj']:.2f}x; "
              f"native / vllm = {results['native']['s/traj'] / results['vllm']['s/traj']:.2f}x")


if __name__ == "__main__":
    main()
