"""The calculator task of grpo_calculator_agent_cpu.yaml written as a verifiers 0.4 environment, the way verifiers'
scaffold (``vf-init``) and its textarena taskset give one: a ``vf.Taskset`` of ``vf.Task``s with an async
``@vf.reward``, and a ``vf.Env`` whose ``run`` is the calculator protocol. It imports nothing from torchrlhf; train it
with ``recipes/configs/grpo_calculator_verifiers_cpu.yaml``.

The model is asked ``What is a * b * c * d?`` after one demonstration exchange (the prompt's first four messages).
A turn holding ``<calc>EXPR</calc>`` gets the result back as the next user message; a turn without one ends the
episode (so does the seat's ``max_turns``). The reward is 1 when the last "The answer is N." in the model's turns
equals the product.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re
from typing import Literal

import verifiers.v1 as vf

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"The answer is\s*(-?[\d,]+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
FEW_SHOT = [vf.UserMessage(content="What is 231 * 47?"), vf.AssistantMessage(content="<calc>231 * 47</calc>"),
            vf.UserMessage(content="10857"), vf.AssistantMessage(content="The answer is 10857.")]


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


class CalculatorData(vf.TaskData):
    answer: str


class CalculatorTask(vf.Task[CalculatorData]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        said = [m.group(1) for m in (ANSWER.search(t.content or "") for t in trace.assistant_messages) if m]
        return 1.0 if said and said[-1].replace(",", "") == self.data.answer else 0.0


class CalculatorConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    num_tasks: int | None = None
    """The first this many problems of ``recipes/data/calculator_{split}.jsonl`` (all of them when unset)."""


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self) -> list[CalculatorTask]:
        with open(os.path.join(DATA, f"calculator_{self.config.split}.jsonl")) as f:
            rows = [json.loads(line) for line in f][: self.config.num_tasks]
        return [CalculatorTask(CalculatorData(prompt=[*FEW_SHOT, vf.UserMessage(content=r["prompt"][-1]["content"])],
                                              answer=r["ground_truth"]), self.config.task)
                for r in rows]


class CalculatorEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=3)


class CalculatorEnv(vf.Env[CalculatorEnvConfig]):
    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            while not segment.terminated and (calls := CALL.findall(segment.last_reply)):
                segment = await chat.turn("\n".join(evaluate(e) for e in calls))


__all__ = ["CalculatorTaskset", "CalculatorEnv"]
