"""Reward functions for trainer tests: a signal a tiny random model can learn in a few steps."""


def e_fraction(solution_str: str, ground_truth, **_) -> float:
    """Share of the response's characters that are the letter 'e' (a random model starts near 5-10%)."""
    return solution_str.count("e") / max(len(solution_str), 1)


def odd_length(solution_str: str, ground_truth, **_) -> float:
    """1 for a response of odd length: a binary reward, so some groups score all 0 or all 1 (dynamic sampling)."""
    return float(len(solution_str) % 2)
