"""The text side of an LLM judge: the prompt it reads and the parser from its verdict to a score.

`torchrlhf.workers.JudgeWorker` renders `render_judge_prompt` for each sample, generates a verdict with an
engine and turns it into a score with `VerdictParser` (configured by a `ParserSpec`). A verdict the parser cannot read, a parser function
that raises, returns a non-number or runs past its time limit is a *failure*: it scores the judge's
``on_failure_score`` and is counted, never raised, so a judge's bad day never stops training.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torchrlhf.config import load_callable
from torchrlhf.utils.isolated import CallTimeout, IsolatedPool, WorkerStartupError

log = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n"
    "Question: {question}\n"
    "Reference answer: {reference}\n"
    "Answer to grade: {response}\n"
    "Is the answer to grade correct? Reply with 'Score: 1' if it is correct and 'Score: 0' if it is not."
)
DEFAULT_REGEX = r"[Ss]core:\s*(-?\d+(?:\.\d+)?)"
TEMPLATE_FIELDS = ("question", "response", "reference")


def check_template(template: str) -> str:
    """``template`` if it formats with exactly the fields `TEMPLATE_FIELDS` may fill; ValueError otherwise."""
    try:
        template.format(**{f: "" for f in TEMPLATE_FIELDS})
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"judge.template: may use only the fields {{question}}, {{response}}, {{reference}} "
                         f"(write literal braces as {{{{ }}}}); formatting failed with {e!r}") from None
    if "{response}" not in template:
        raise ValueError("judge.template: has no {response} field, so the judge would never see the answer")
    return template


def render_judge_prompt(template: str, question: str, response: str, reference: Any) -> str:
    """The judge's prompt for one sample (a missing reference reads as an empty string)."""
    return template.format(question=question, response=response, reference="" if reference is None else reference)


@dataclass(frozen=True)
class ParserSpec:
    """The ``judge.parser`` section: verdict text -> score by ``regex`` (its first group, else the whole match,
    read as a float; default `DEFAULT_REGEX`, ``Score: <number>``) or by a user function ``fn(verdict: str) ->
    float | None`` (``pkg.mod:fn``, ``/path/file.py:fn``) under ``timeout_s`` per call.

    Checked once, where it is built (the controller's config check): the regex compiles, the function imports.
    The worker receives the checked spec and builds its `VerdictParser` from it.
    """

    regex: str | None = None
    fn: str | None = None
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.regex is not None and self.fn is not None:
            raise ValueError(f"fn: set regex or fn, not both (got regex={self.regex!r} and fn={self.fn!r})")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s: must be > 0, got {self.timeout_s}")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"regex: {self.regex!r} is not a regular expression: {e}") from None
        if self.fn is not None:
            load_callable(self.fn, what="judge.parser.fn")  # fail at start, with a clear error



class VerdictParser:
    """A `ParserSpec` at work. A function runs in a worker process under the spec's ``timeout_s`` (a hung
    call cannot be stopped in a thread), like user reward functions (`torchrlhf.rewards.RewardManager`)."""

    def __init__(self, spec: ParserSpec | None = None, *, startup_timeout_s: float = 300.0) -> None:
        spec = spec or ParserSpec()
        self.fn = spec.fn
        self.timeout_s, self.startup_timeout_s = spec.timeout_s, startup_timeout_s
        self.regex = re.compile(spec.regex or DEFAULT_REGEX) if spec.fn is None else None
        self._pool: IsolatedPool | None = None

    def __call__(self, verdicts: Sequence[str]) -> tuple[list[float | None], list[bool]]:
        """Each verdict's score (None where it failed) and whether its parser call timed out."""
        if self.regex is not None:
            return [self._regex_score(v) for v in verdicts], [False] * len(verdicts)
        if self._pool is None:
            self._pool = IsolatedPool(1, self.timeout_s, self.startup_timeout_s)
        results = self._pool.run([(self.fn, (v,), {}) for v in verdicts])
        for r in results:
            if isinstance(r, WorkerStartupError):
                raise r
        scores = [None if isinstance(r, BaseException) else _finite(r) for r in results]
        return scores, [isinstance(r, CallTimeout) for r in results]

    def _regex_score(self, verdict: str) -> float | None:
        match = self.regex.search(verdict)
        if match is None:
            return None
        try:
            return _finite(float(match.group(1) if match.groups() else match.group(0)))
        except (TypeError, ValueError):
            return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


_YES = frozenset({"correct", "yes", "right", "true"})
_NO = frozenset({"wrong", "incorrect", "no", "false"})


def correct_or_wrong(verdict: str) -> float | None:
    """A word verdict as a score: 1.0 when its first word is correct / yes / right / true, 0.0 when it is
    wrong / incorrect / no / false, None (unparseable) otherwise. For judges too small to write a number
    (``parser_fn: torchrlhf.rewards.judge.correct_or_wrong``)."""
    words = re.findall(r"[a-z]+", verdict.lower())
    if not words:
        return None
    return 1.0 if words[0] in _YES else 0.0 if words[0] in _NO else None
