"""Write the calculator-agent prompt sets: "What is a * b * c * d?" (a three-digit, the rest two-digit).

SmolLM2-135M cannot multiply four numbers in its head, and is told about the calculator only by
one demonstration exchange at the start of the conversation (user question -> assistant
``<calc>231 * 47</calc>`` -> user turn with the result -> assistant "The answer is 10857."). The
demonstration multiplies two numbers, the questions four, so a policy has to learn to call the
tool instead of guessing, to put every factor in the expression, and to copy the 7-9 digit result
into a marked final answer.

Measured on the first 8 test prompts x 8 samples, T = 0.7, HF generate, through `AgentSession`
(``tools/bench/probe_agent.py``), two seeds: 44/128 right with the tool (34 %; failures: 48 no
call, 20 wrong expression, 16 right result not copied); 0/64 without it (the no-tool prompts,
max 64 tokens). Three factors: 54/128 (42 %) with the tool, 0/64 without.

Each line: chat ``prompt`` messages, ``ground_truth`` (the product) and ``data_source``
"calculator" (reward: `torchrlhf.rewards.calculator`, the marked final answer). The test problems
never appear in the train file. ``--no-tool`` also writes the baseline prompts for the same
problems: the demonstration answers directly, without a tool call.

    python tools/prepare_calculator.py --out recipes/data --no-tool
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random

DEMO_QUESTION, DEMO_EXPRESSION, DEMO_ANSWER = "What is 231 * 47?", "231 * 47", 10857


def make_problem(factors: tuple[int, ...], *, tool: bool = True) -> dict:
    if tool:
        demo = [{"role": "user", "content": DEMO_QUESTION},
                {"role": "assistant", "content": f"<calc>{DEMO_EXPRESSION}</calc>"},
                {"role": "user", "content": str(DEMO_ANSWER)},
                {"role": "assistant", "content": f"The answer is {DEMO_ANSWER}."}]
    else:
        demo = [{"role": "user", "content": DEMO_QUESTION},
                {"role": "assistant", "content": f"The answer is {DEMO_ANSWER}."}]
    return {
        "prompt": [*demo, {"role": "user", "content": f"What is {' * '.join(map(str, factors))}?"}],
        "ground_truth": str(math.prod(factors)),
        "data_source": "calculator",
    }


def sample_problems(n: int, seed: int, num_factors: int = 3) -> list[tuple[int, ...]]:
    """``n`` distinct factor tuples: a three-digit number, then two-digit ones."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    while len(seen) < n:
        seen.add((rng.randint(100, 999), *(rng.randint(10, 99) for _ in range(num_factors - 1))))
    problems = sorted(seen)
    rng.shuffle(problems)
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="recipes/data")
    parser.add_argument("--train", type=int, default=1024)
    parser.add_argument("--test", type=int, default=128, help="held-out problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--factors", type=int, default=4, help="numbers multiplied per question")
    parser.add_argument("--no-tool", action="store_true", help="also write the no-tool baseline prompts")
    args = parser.parse_args()
    if args.train < 1 or args.test < 1 or args.factors < 2:
        raise SystemExit("--train and --test must be >= 1, --factors >= 2")
    problems = sample_problems(args.train + args.test, args.seed, args.factors)
    splits = {"test": problems[: args.test], "train": problems[args.test :]}
    os.makedirs(args.out, exist_ok=True)
    variants = [("calculator", True)] + ([("calculator_notool", False)] if args.no_tool else [])
    for prefix, tool in variants:
        for split, rows in splits.items():
            path = os.path.join(args.out, f"{prefix}_{split}.jsonl")
            with open(path, "w") as f:
                for factors in rows:
                    f.write(json.dumps(make_problem(factors, tool=tool)) + "\n")
            print(f"wrote {len(rows)} problems to {path}")


if __name__ == "__main__":
    main()
