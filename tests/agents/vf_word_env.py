"""A verifiers 0.4 environment module written the way verifiers' scaffold (``vf-init``) and its textarena taskset give
it: a ``vf.Taskset`` of ``vf.Task``s with an async ``@vf.reward``, and a ``vf.Env`` whose ``run`` is the multi-turn
protocol. Loaded by name: ``rollout.agent.verifiers.env: vf_word_env`` (the folder on ``PYTHONPATH``).

The task: say the row's word, then say it again when the env asks. The reward is the fraction of model turns that
contain the word (0, 0.5 or 1). Config fields: ``num_examples``; ``split: eval`` gives other words (with their own
``info``); ``secret``: every task asks the same question (the word is only in ``answer``), a game whose prompt text
does not tell its tasks apart; ``task.broken``: the reward raises; ``task.tools``: an ``add`` tool (an MCP toolset,
this module run as ``python -m vf_word_env``).
"""

from __future__ import annotations

from typing import Literal

import verifiers.v1 as vf

WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ocean", "pearl"]


class WordToolset(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "word"

    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)


class WordData(vf.TaskData):
    answer: str
    info: dict = {}


class WordTaskConfig(vf.TaskConfig):
    broken: bool = False
    tools: bool = False
    toolset: vf.ToolsetConfig = vf.ToolsetConfig()


class WordTask(vf.Task[WordData, vf.State, WordTaskConfig]):
    @classmethod
    def toolsets(cls, config: WordTaskConfig) -> list[vf.Toolset]:
        return [WordToolset(config.toolset)] if config.tools else []

    @vf.reward(weight=1.0)
    async def turns_with_word(self, trace: vf.Trace) -> float:
        if self.config.broken:
            raise RuntimeError("the grader is down")
        turns = [(m.content or "").lower() for m in trace.assistant_messages]
        return sum(self.data.answer in t for t in turns) / max(len(turns), 1)


class WordConfig(vf.TasksetConfig):
    num_examples: int = 8
    split: Literal["train", "eval"] = "train"
    secret: bool = False
    task: WordTaskConfig = WordTaskConfig()


class WordTaskset(vf.Taskset[WordTask, WordConfig]):
    def load(self) -> list[WordTask]:
        words, first = (WORDS, 0) if self.config.split == "train" else (WORDS[::-1], 100)
        return [WordTask(WordData(prompt="Say the secret word." if self.config.secret else f"Say the word '{w}'.",
                                  system_prompt="You repeat words.", answer=w, info={"index": first + i}),
                         self.config.task)
                for i, w in enumerate(words[: self.config.num_examples])]


class WordEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime=vf.SubprocessConfig(), max_turns=4)


class WordEnv(vf.Env[WordEnvConfig]):
    async def run(self, task, agents) -> None:
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()  # a prompted task: the model speaks first
            if not segment.terminated:
                await chat.turn("Say it again.")


__all__ = ["WordTaskset", "WordEnv"]

if __name__ == "__main__":
    WordToolset.run()
