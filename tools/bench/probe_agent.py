"""Probe an agent task before training: sample trajectories with HF generate and sort the failures.

Drives `torchrlhf.agents.AgentSession`s (token-exact observations, the same code a training run
uses) with a plain Hugging Face ``generate`` per turn, batched over the live trajectories, then
grades each final turn with the data source's reward and sorts every trajectory into: correct;
no tool call; a call whose result is not the answer (wrong expression); the right result but a
wrong or unmarked final answer (not copied). ``--no-tools`` samples one plain turn per prompt
(the no-tool baseline). Prints one JSON line with the counts, then a few trajectories.

    python tools/bench/probe_agent.py --data recipes/data/calculator_test.jsonl
    python tools/bench/probe_agent.py --data recipes/data/calculator_notool_test.jsonl --no-tools --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from torchrlhf.agents import AgentSession, build_agent  # noqa: E402
from torchrlhf.data.dataset import read_rows  # noqa: E402
from torchrlhf.models import load_tokenizer, smollm2_model_dir  # noqa: E402
from torchrlhf.rewards import get_reward_fn  # noqa: E402
from torchrlhf.rewards._numbers import NUMBER_RE, parse_number  # noqa: E402

CALCULATOR_AGENT = {"tools": ["calculator"], "tool_calls": {"format": "tags", "tags": {"calc": "calculator"}},
                    "isolate": False}


@torch.no_grad()
def sample_turn(model, prompts: list[list[int]], budgets: list[int], pad_id: int, stop_id: int,
                temperature: float) -> list[tuple[list[int], str]]:
    """One turn for each prompt (left-padded batch): (tokens up to and with the stop token, finish reason)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_p=1.0,
                         top_k=0, max_new_tokens=max(budgets), eos_token_id=stop_id, pad_token_id=pad_id)
    turns = []
    for row, budget in zip(out[:, width:].tolist(), budgets):
        if stop_id in row[:budget]:
            turns.append((row[: row.index(stop_id) + 1], "stop"))
        else:
            turns.append((row[:budget], "length"))
    return turns


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--agent", default=json.dumps(CALCULATOR_AGENT), help="rollout.agent config as JSON")
    parser.add_argument("--no-tools", action="store_true", help="one plain turn per prompt (baseline)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=128, help="model tokens over all turns")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model_dir = args.model or smollm2_model_dir()
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = read_rows(args.data)[: args.prompts]
    # One turn allowed: a tool call in it is never run, so the baseline answers alone.
    agent_cfg = {**json.loads(args.agent), "max_turns": 1 if args.no_tools else args.max_turns}
    agent = build_agent(agent_cfg, tokenizer, max_tokens=args.max_tokens)
    sessions = [AgentSession(agent, row) for row in rows for _ in range(args.n)]
    stop_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    start = time.time()
    while live := [s for s in sessions if s.turn_budget() > 0]:
        turns = sample_turn(model, [s.tokens for s in live], [s.turn_budget() for s in live], pad_id, stop_id,
                            args.temperature)
        for session, (tokens, finish) in zip(live, turns):
            session.end_turn(tokens, finish).result()
    counts = dict.fromkeys(("correct", "no_call", "wrong_expr", "not_copied"), 0)
    per_prompt, calls, examples = [0] * len(rows), 0, []
    for i, session in enumerate(sessions):
        traj, row = session.result(), session.row
        truth = parse_number(str(row["ground_truth"]))
        score = get_reward_fn(row["data_source"])(traj.final_text, row["ground_truth"])
        observations = [m["content"] for m in session.messages[len(row["prompt"]):] if m["role"] != "assistant"]
        right_call = any(parse_number(x) == truth for obs in observations for x in NUMBER_RE.findall(obs))
        kind = ("correct" if score == 1.0 else "no_call" if not traj.metrics.get("tool_calls")
                else "wrong_expr" if not right_call else "not_copied")
        counts[kind] += 1
        per_prompt[i // args.n] += score == 1.0
        calls += traj.metrics.get("tool_calls", 0)
        if i % args.n == 0 and len(examples) < args.show:
            examples.append((row["prompt"][-1]["content"], row["ground_truth"], kind,
                             [m["content"][:100] for m in session.messages[len(row["prompt"]):]]))
    total = len(sessions)
    print(json.dumps({"data": args.data, "tools": not args.no_tools, **counts, "accuracy": counts["correct"] / total,
                      "tool_calls_per_trajectory": calls / total, "per_prompt_correct": per_prompt,
                      "seconds": round(time.time() - start)}))
    for question, truth, kind, turns in examples:
        print(f"  [{kind}] {question} (= {truth}): {turns}")
    agent.close()


if __name__ == "__main__":
    main()
