"""Per-step data metrics under verl's names, so runs compare across frameworks."""

from __future__ import annotations

import resource
import sys

import torch

from torchrlhf.agents import AGENT_COLUMNS
from torchrlhf.data import Batch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _masked_values(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()]


def compute_data_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values and lengths of one training batch."""
    response_mask = batch["response_mask"]
    prompt_mask = batch["attention_mask"][:, : batch["prompts"].shape[1]]
    response_length = response_mask.sum(-1).float()
    metrics: dict[str, float] = {}
    metrics.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    metrics.update(_stats("critic/advantages", _masked_values(batch["advantages"], response_mask)))
    metrics.update(_stats("critic/returns", _masked_values(batch["returns"], response_mask)))
    if "values" in batch:
        metrics.update(_stats("critic/values", _masked_values(batch["values"], response_mask)))
    if "cost_scores" in batch:
        metrics.update(_stats("critic/cost", batch["cost_scores"]))
    metrics.update(_stats("response_length", response_length))
    metrics["response_length/clip_ratio"] = (response_length >= max_response_length).float().mean().item()
    metrics.update(_stats("prompt_length", prompt_mask.sum(-1).float()))
    metrics.update(agent_metrics(batch))
    return metrics


def agent_metrics(batch: Batch) -> dict[str, float]:
    """Multi-turn rollouts (the `torchrlhf.agents.AGENT_COLUMNS`), verl's ``num_turns/*`` and per-trajectory
    means of the others (tool calls, tool errors and timeouts, environment errors, observation tokens, the
    environment's reward, ...); the environment's reward per model turn."""
    if "num_turns" not in batch:
        return {}
    turns = batch["num_turns"]
    metrics = _stats("num_turns", turns)
    for key in AGENT_COLUMNS:
        if key != "num_turns" and key in batch:
            metrics[f"agent/{key}/mean"] = batch[key].float().mean().item()
    metrics["agent/turn_reward/mean"] = (batch["env_reward"].sum() / turns.sum().clamp(min=1)).item()
    return metrics


def rollout_mismatch_metrics(batch: Batch) -> dict[str, float]:
    """How far the rollout engine's token probabilities are from the training forward's (verl's names).

    Both score the same tokens with the same weights, so the gap is only kernel and
    precision noise; a large gap means the engine sampled from other weights (a
    missed weight sync) or another model/temperature. Empty when either column is absent.
    """
    if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
        return {}
    diff = _masked_values((batch["rollout_log_probs"].float().exp() - batch["old_log_probs"].float().exp()).abs(),
                          batch["response_mask"])
    if diff.numel() == 0:
        return {}
    return {"training/rollout_probs_diff_mean": diff.mean().item(), "training/rollout_probs_diff_max": diff.max().item()}


def compute_throughput_metrics(batch: Batch, step_seconds: float, num_devices: int) -> dict[str, float]:
    """Tokens (prompt + response) processed per second per device, verl's ``perf/throughput``."""
    total_tokens = batch["attention_mask"].sum().item()
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/throughput": total_tokens / max(step_seconds, 1e-9) / max(num_devices, 1),
        "perf/max_memory_allocated_gb": max_memory_gb(),
    }


def max_memory_gb() -> float:
    """Peak device memory on GPU; on CPU the controller process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def validation_summary(before: dict[str, float], after: dict[str, float]) -> str:
    """"validation before -> after training: val/x/acc 0.340 -> 0.660 (+32.0 pts)", or "" without both."""
    names = sorted(k for k in before if k.startswith("val/") and k in after)
    parts = [f"{k} {before[k]:.3f} -> {after[k]:.3f} ({100 * (after[k] - before[k]):+.1f} pts)" for k in names]
    return "validation before -> after training: " + ", ".join(parts) if parts else ""
