"""The calculator-agent task ("What is 268 * 39 * 13 * 77?", answered with a calculator tool).

The answer must be *marked* — "The answer is 10462452." as the prompt's demonstration shows (or
``#### N`` / ``\\boxed{N}``) — and the last marked answer must equal the reference. Marking is
required because the tool's own output is in the conversation: with the flexible "last number"
rule, a trajectory that called the tool and never stated an answer would be scored by the tool's
result. Grade the final model turn (`torchrlhf.agents.Trajectory.final_text`); the whole decoded
response gives the same score, since observations never hold a marked answer.
"""

from __future__ import annotations

from torchrlhf.rewards._numbers import integer_score, marked_answer


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    """1.0 when the last marked answer of ``solution_str`` equals the integer ``ground_truth``, else 0.0."""
    return integer_score("calculator", marked_answer(solution_str), ground_truth)
