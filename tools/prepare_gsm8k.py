"""Convert GSM8K jsonl (``question`` / ``answer`` ending in ``#### N``) into torchrlhf's prompt format.

Each output line: chat ``prompt`` messages (the question plus an instruction to end with
``#### <answer>``), ``ground_truth`` (N without thousands commas), ``data_source``
"openai/gsm8k" (scored by `torchrlhf.rewards.gsm8k`) and ``extra_info`` (split, index).

    python tools/prepare_gsm8k.py --input-dir ../shared/data/gsm8k --out data/gsm8k
    # -> data/gsm8k/gsm8k_train.jsonl, data/gsm8k/gsm8k_test.jsonl: what the GSM8K configs read

The input is GSM8K as published (MIT): ``train.jsonl`` and ``test.jsonl`` of
github.com/openai/grade-school-math, folder ``grade_school_math/data``.
"""

from __future__ import annotations

import argparse
import json
import os
import re

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
_FINAL = re.compile(r"####\s*(.+?)\s*$")


def convert_row(row: dict, split: str, index: int, where: str) -> dict:
    try:
        question, answer = row["question"], row["answer"]
    except KeyError as e:
        raise ValueError(f"{where}: missing field {e.args[0]!r} (GSM8K rows have 'question' and 'answer')") from None
    match = _FINAL.search(answer.strip().splitlines()[-1] if answer.strip() else "")
    if match is None:
        raise ValueError(f"{where}: the answer does not end with '#### <number>': {answer[-80:]!r}")
    return {
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ground_truth": match.group(1).replace(",", ""),
        "data_source": "openai/gsm8k",
        "extra_info": {"split": split, "index": index},
    }


def convert_file(src: str, dst: str, split: str) -> int:
    count = 0
    with open(src) as fin, open(dst, "w") as fout:
        for lineno, line in enumerate(fin, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{src}:{lineno}: not valid JSON ({e.msg})") from None
            fout.write(json.dumps(convert_row(row, split, count, f"{src}:{lineno}")) + "\n")
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input-dir", default="../shared/data/gsm8k", help="folder with train.jsonl and test.jsonl")
    parser.add_argument("--out", default="data/gsm8k", help="output folder (the GSM8K configs read data/gsm8k)")
    parser.add_argument("--splits", nargs="+", default=["train", "test"])
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for split in args.splits:
        src = os.path.join(args.input_dir, f"{split}.jsonl")
        if not os.path.isfile(src):
            raise SystemExit(f"GSM8K file not found: {src}; --input-dir takes the folder holding GSM8K's "
                             "train.jsonl and test.jsonl (github.com/openai/grade-school-math, grade_school_math/data)")
        dst = os.path.join(args.out, f"gsm8k_{split}.jsonl")
        print(f"wrote {convert_file(src, dst, split)} prompts to {dst}")


if __name__ == "__main__":
    main()
