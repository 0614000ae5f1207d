"""Write the arithmetic prompt sets: every "a + b" / "a - b" with 0 <= a, b <= max_operand, split in two.

Each line: chat ``prompt`` messages, ``ground_truth`` (the integer answer) and
``data_source`` "arithmetic", the format `torchrlhf.data.PromptDataset` reads. The test problems
are drawn without replacement from the whole problem space and never appear in the train file,
so validation accuracy is measured on held-out problems (operands up to 20: 882 problems, of which
256 are held out and the other 626 are the train set).

    python tools/prepare_arithmetic.py --out recipes/data --test 256
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random


def make_problem(a: int, op: str, b: int) -> dict:
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
    parser.add_argument("--test", type=int, default=256, help="held-out problems; the rest is the train set")
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    operands = range(args.max_operand + 1)
    problems = list(itertools.product(operands, "+-", operands))
    if not 0 < args.test < len(problems):
        raise SystemExit(f"--test must be between 1 and {len(problems) - 1} (there are {len(problems)} problems)")
    random.Random(args.seed).shuffle(problems)
    splits = {"test": problems[: args.test], "train": problems[args.test :]}
    os.makedirs(args.out, exist_ok=True)
    for split, rows in splits.items():
        path = os.path.join(args.out, f"arithmetic_{split}.jsonl")
        with open(path, "w") as f:
            for a, op, b in rows:
                f.write(json.dumps(make_problem(a, op, b)) + "\n")
        print(f"wrote {len(rows)} problems to {path}")


if __name__ == "__main__":
    main()
