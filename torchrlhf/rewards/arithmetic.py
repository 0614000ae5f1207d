"""The arithmetic task ("What is 13 - 6?" -> "7"): the response's final answer must equal the reference.

The final answer is found the way GSM8K's "flexible" grading finds it, because small instruct
models rarely answer with the bare number: they restate the question ("13 - 6 = 7") or explain
("The answer is 7."). Grading the *first* number instead scores the restated operand and gives
GRPO almost no signal (SmolLM2-135M: 4/64 correct that way on answers it mostly got right).
"""

from __future__ import annotations

from torchrlhf.rewards._numbers import integer_score, extract_final_number


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    """1.0 when the final number of ``solution_str`` equals the integer ``ground_truth``, else 0.0."""
    return integer_score("arithmetic", extract_final_number(solution_str), ground_truth)
