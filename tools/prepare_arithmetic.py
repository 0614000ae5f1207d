"""Write a small synthetic arithmetic prompt set (the CPU default config's data).

Each line: chat ``prompt`` messages, ``ground_truth`` (the integer answer) and
``data_source`` "arithmetic", the format `torchrlhf.data.PromptDataset` reads.

    python tools/prepare_arithmetic.py --out recipes/data --train 256 --test 64
"""

from __future__ import annotations

import argparse
import json
import os
import random


def make_problem(rng: random.Random, max_operand: int) -> dict:
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice(["+", "-"])
    answer = a + b if op == "+" else a - b
    question = f"What is {a} {op} {b}? Reply with the number only."
    return {
        "prompt": [{"role": "user", "content": question}],
        "ground_truth": str(answer),
        "data_source": "arithmetic",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="recipes/data")
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--test", type=int, default=64)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    for split, count in (("train", args.train), ("test", args.test)):
        path = os.path.join(args.out, f"arithmetic_{split}.jsonl")
        with open(path, "w") as f:
            for _ in range(count):
                f.write(json.dumps(make_problem(rng, args.max_operand)) + "\n")
        print(f"wrote {count} problems to {path}")


if __name__ == "__main__":
    main()
