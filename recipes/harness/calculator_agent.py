"""The calculator task as a black-box agent harness: a plain ``openai`` client loop, trained through the
OpenAI-compatible endpoint (``rollout.agent.harness``, `torchrlhf.agents.harness`).

The same task as ``recipes/configs/grpo_calculator_agent_cpu.yaml`` (the model writes ``<calc>EXPR</calc>``,
the result comes back as the next user message, the answer is "The answer is N."), written the way an
agent outside torchrlhf would be: the harness owns the tool loop and returns the reward.
"""

from __future__ import annotations

import re

import openai

from torchrlhf.agents.builtin import calculator
from torchrlhf.rewards.calculator import compute_score

MAX_TURNS = 3


def run_agent(base_url: str, row: dict) -> float:
    """One trajectory: up to ``MAX_TURNS`` model turns; 1.0 when the final answer is right."""
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = list(row["prompt"])
    text = ""
    for _ in range(MAX_TURNS):
        reply = client.chat.completions.create(model="policy", messages=messages)
        choice = reply.choices[0]
        text = choice.message.content or ""
        call = re.search(r"<calc>(.*?)</calc>", text, re.DOTALL)
        if call is None or choice.finish_reason == "length":
            break
        messages.append({"role": "assistant", "content": text})
        messages.append({"role": "user", "content": calculator(call.group(1))})
    return compute_score(text, row["ground_truth"])
