"""A verifiers environment module written in the shape verifiers' docs give (``load_environment`` returning a
``vf.MultiTurnEnv`` with a dataset and a ``vf.Rubric``), loaded by name: ``rollout.agent.verifiers.env: vf_word_env``.

The task: say the row's word, then say it again when asked. The rubric gives 1 per model turn that contains the
word, over the turns (so 0, 0.5 or 1). ``tools=True`` builds a ``vf.ToolEnv`` with an ``add`` tool instead.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pearl"]


class RepeatWordEnv(vf.MultiTurnEnv):
    async def is_completed(self, messages, state, **kwargs) -> bool:
        return state["turn"] >= 2

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "Say it again."}], state


def turns_with_word(completion, answer, **kwargs) -> float:
    turns = [m["content"] for m in completion if m["role"] == "assistant"]
    return sum(answer in t.lower() for t in turns) / max(len(turns), 1)


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return str(a + b)


def load_environment(num_examples: int = 8, tools: bool = False, **kwargs) -> vf.Environment:
    rows = [{"question": f"Say the word '{w}'.", "answer": w, "info": {"index": i}}
            for i, w in enumerate(WORDS[:num_examples])]
    dataset = Dataset.from_list(rows)
    rubric = vf.Rubric(funcs=[turns_with_word], weights=[1.0])
    system = "You repeat words."
    if tools:
        return vf.ToolEnv(tools=[add], dataset=dataset, eval_dataset=dataset, rubric=rubric, system_prompt=system,
                          max_turns=3)
    return RepeatWordEnv(dataset=dataset, eval_dataset=dataset, rubric=rubric, system_prompt=system, max_turns=3)
