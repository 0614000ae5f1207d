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


class RubricDown(vf.Rubric):
    """A rubric whose scoring itself fails (``broken_rubric=True``); verifiers' own Rubric catches a reward function
    that raises and scores it 0, so only a failure of ``score_rollout`` reaches the trainer."""

    async def score_rollout(self, *args, **kwargs):
        raise RuntimeError("the rubric's grader is down")


def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: the first integer.
        b: the second integer.
    """
    return str(a + b)


def load_environment(num_examples: int = 8, tools: bool = False, secret: bool = False, broken_rubric: bool = False,
                     **kwargs) -> vf.Environment:
    """``secret=True``: every row asks the same question (the word is only in its ``answer``), a game whose prompt
    text does not tell its rows apart; the eval rows are then other words with their own ``info``."""
    def rows(words: list[str], first: int) -> list[dict]:
        return [{"question": "Say the secret word." if secret else f"Say the word '{w}'.", "answer": w,
                 "info": {"index": first + i}} for i, w in enumerate(words)]

    dataset = Dataset.from_list(rows(WORDS[:num_examples], 0))
    eval_dataset = Dataset.from_list(rows(WORDS[::-1][:num_examples], 100)) if secret else dataset
    rubric = (RubricDown if broken_rubric else vf.Rubric)(funcs=[turns_with_word], weights=[1.0])
    system = "You repeat words."
    if tools:
        return vf.ToolEnv(tools=[add], dataset=dataset, eval_dataset=eval_dataset, rubric=rubric, system_prompt=system,
                          max_turns=3)
    return RepeatWordEnv(dataset=dataset, eval_dataset=eval_dataset, rubric=rubric, system_prompt=system, max_turns=3)
