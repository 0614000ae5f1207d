"""The calculator task of grpo_calculator_agent_cpu.yaml written as a verifiers environment, in the shape verifiers'
docs give: ``load_environment`` returns a ``vf.MultiTurnEnv`` with a dataset, few-shot messages and a ``vf.Rubric``.
It imports nothing from torchrlhf; train it with ``recipes/configs/grpo_calculator_verifiers_cpu.yaml``.

The model is asked ``What is a * b * c * d?`` after one demonstration exchange. A turn holding ``<calc>EXPR</calc>``
gets the result back as the next user message; a turn without one ends the episode. The rubric gives 1 when the
last "The answer is N." in the model's turns equals the product.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re

import verifiers as vf
from datasets import Dataset

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"The answer is\s*(-?[\d,]+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> str:
    """``+ - *`` over integers, or an error text the model reads as its observation."""

    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("only integers with + - *")

    try:
        return str(walk(ast.parse(expression.strip().replace("×", "*"), mode="eval").body))
    except (SyntaxError, ValueError) as e:
        return f"Error: {e}"


class CalculatorEnv(vf.MultiTurnEnv):
    async def is_completed(self, messages, state, **kwargs) -> bool:
        return messages[-1]["role"] == "assistant" and not CALL.search(messages[-1]["content"])

    async def env_response(self, messages, state, **kwargs):
        results = [evaluate(expr) for expr in CALL.findall(messages[-1]["content"])]
        return [{"role": "user", "content": "\n".join(results)}], state


def correct_answer(completion, answer, **kwargs) -> float:
    said = [m.group(1) for m in (ANSWER.search(t["content"]) for t in completion if t["role"] == "assistant") if m]
    return 1.0 if said and said[-1].replace(",", "") == str(answer) else 0.0


def _rows(name: str, limit: int | None) -> Dataset:
    """The question and answer of each row of ``recipes/data/calculator_{name}.jsonl`` (its last user message)."""
    with open(os.path.join(DATA, f"calculator_{name}.jsonl")) as f:
        rows = [json.loads(line) for line in f][:limit]
    return Dataset.from_list([{"question": r["prompt"][-1]["content"], "answer": r["ground_truth"]} for r in rows])


def load_environment(num_train: int | None = None, num_eval: int | None = None, **kwargs) -> vf.Environment:
    few_shot = [{"role": "user", "content": "What is 231 * 47?"},
                {"role": "assistant", "content": "<calc>231 * 47</calc>"},
                {"role": "user", "content": "10857"},
                {"role": "assistant", "content": "The answer is 10857."}]
    return CalculatorEnv(dataset=_rows("train", num_train), eval_dataset=_rows("test", num_eval), few_shot=few_shot,
                         rubric=vf.Rubric(funcs=[correct_answer], weights=[1.0]), max_turns=3, **kwargs)
