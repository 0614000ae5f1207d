"""On-policy distillation: a per-token reverse-KL advantage from a teacher's log-probs of the student's samples.

The student samples ``y ~ pi_s``; the teacher scores each sampled token. ``log pi_s(y_t) - log pi_t(y_t)`` is
the single-sample estimate of the reverse KL ``KL(pi_s || pi_t)`` at step t (its expectation under ``pi_s``
is the KL), so its negative is a dense, per-token advantage: tokens the teacher finds likelier than the
student are pushed up (Agarwal et al., GKD; Thinking Machines, "On-Policy Distillation"). Each token's
advantage is its own term only (no discounting across tokens), and it is not normalised.
"""

from __future__ import annotations

import torch

from torchrlhf.algorithms.masked import masked_mean


def reverse_kl_advantage(student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor,
                         response_mask: torch.Tensor) -> torch.Tensor:
    """``-(log pi_s(y_t) - log pi_t(y_t))`` on the tokens ``response_mask`` keeps, 0 elsewhere ([B, R] float32).

    A multi-turn agent's mask drops its observation tokens: the student did not sample them, so they get
    no distillation signal, as they get no policy loss.
    """
    mask = response_mask.float()
    return (teacher_log_probs.float() - student_log_probs.float()) * mask


def distill_advantages(task_advantages: torch.Tensor, student_log_probs: torch.Tensor,
                       teacher_log_probs: torch.Tensor, response_mask: torch.Tensor, *, coef: float,
                       task_coef: float) -> tuple[torch.Tensor, float]:
    """``A_t = task_coef * A_task_t + coef * (log pi_t(y_t) - log pi_s(y_t))`` on the response tokens, and
    the batch's reverse KL (token mean of ``log pi_s - log pi_t`` over those tokens) for ``distill/reverse_kl``.

    ``task_coef=0`` is pure on-policy distillation; ``coef=0`` leaves the task's advantage as it was.
    """
    distill = reverse_kl_advantage(student_log_probs, teacher_log_probs, response_mask)
    mask = response_mask.float()
    advantages = (task_coef * task_advantages.float() + coef * distill) * mask
    return advantages, masked_mean(-distill, mask).item()


__all__ = ["distill_advantages", "reverse_kl_advantage"]
