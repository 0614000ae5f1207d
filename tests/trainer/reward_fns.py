"""Reward functions for trainer tests: a signal a tiny random model can learn in a few steps."""


def e_fraction(solution_str: str, ground_truth, **_) -> float:
    """Share of the response's characters that are the letter 'e' (a random model starts near 5-10%)."""
    return solution_str.count("e") / max(len(solution_str), 1)
