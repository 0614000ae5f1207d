"""Scoring generated responses with rule / user reward functions under a time limit.

`RewardManager` turns a generation `Batch` into ``token_level_scores [B, R]`` (the sample's
score on its last response token, zeros elsewhere) and metrics. A reward function that
raises, returns a non-number, or runs past ``timeout_s`` scores ``on_error_score`` and is
counted (``reward/errors``, ``reward/timeouts``); training goes on.

Where code runs: the bounded-cost built-ins (GSM8K, countdown, arithmetic) run in this
process. Everything else — user functions, sympy-based math — runs in worker processes
(`torchrlhf.utils.isolated.IsolatedPool`, shared with agent tools), because a hung Python call
cannot be interrupted in a thread: on a timeout the pool's processes are killed and a fresh pool is
started. User reward code runs with the permissions of the user who launched training; only
configure code you trust.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from torchrlhf.algorithms.masked import at_last_token
from torchrlhf.data.batch import Batch
from torchrlhf.rewards.registry import IN_PROCESS_SAFE, RewardFn, get_reward_fn, load_reward_fn
from torchrlhf.utils.isolated import CallTimeout, IsolatedPool, WorkerStartupError

log = logging.getLogger(__name__)

_TIMEOUT = object()
_MAX_LOGGED_ERRORS = 3


class RewardManager:
    """Score responses with reward functions chosen per sample.

    Args:
        reward_fn: None -> the built-in reward for each sample's ``data_source``; a callable
            (importable at module level, so worker processes can load it) or a spec string
            (``pkg.mod:fn``, ``pkg.mod.fn``, ``/path/file.py:fn``) -> used for every sample; a
            mapping ``data_source -> callable | spec`` -> per source, built-ins for the rest.
        tokenizer: decodes ``responses`` (special tokens skipped); needed for ``__call__`` only.
        timeout_s: time limit of one reward call in a worker process.
        num_workers: worker processes for isolated calls.
        on_error_score: the score of a call that raised, timed out or returned a non-number.
        reward_kwargs: extra keyword arguments passed to every reward function.
        isolate: False runs every function in this process (no time limit; for trusted code, notebooks).
        startup_timeout_s: how long starting the worker pool may take (imports torch).
        weight: the rule score's weight in a training sample's reward, beside an LLM judge's ``judge.weight``
            (applied where rewards are composed, `torchrlhf.rollouts.Scorer`; validation accuracy is unweighted).
    """

    def __init__(
        self,
        reward_fn: RewardFn | str | Mapping[str, RewardFn | str] | None = None,
        *,
        tokenizer: Any = None,
        timeout_s: float = 10.0,
        num_workers: int = 1,
        on_error_score: float = 0.0,
        reward_kwargs: Mapping[str, Any] | None = None,
        isolate: bool = True,
        startup_timeout_s: float = 300.0,
        weight: float = 1.0,
    ) -> None:
        if timeout_s <= 0 or num_workers < 1:
            raise ValueError(f"RewardManager: need timeout_s > 0 and num_workers >= 1, got {timeout_s}, {num_workers}")
        self.tokenizer = tokenizer
        self.timeout_s = float(timeout_s)
        self.num_workers = int(num_workers)
        self.on_error_score = float(on_error_score)
        self.reward_kwargs = dict(reward_kwargs or {})
        self.isolate = isolate
        self.startup_timeout_s = startup_timeout_s
        self.weight = float(weight)
        self._default: RewardFn | str | None = None
        self._per_source: dict[str, RewardFn | str] = {}
        if isinstance(reward_fn, Mapping):
            self._per_source = {k: self._check_target(v) for k, v in reward_fn.items()}
        elif reward_fn is not None:
            self._default = self._check_target(reward_fn)
        self._loaded: dict[str, RewardFn] = {}
        self._pool: IsolatedPool | None = None

    # ------------------------------------------------------------------ public
    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """(``token_level_scores [B, R]`` float32, metrics) for a generation batch."""
        if self.tokenizer is None:
            raise ValueError("RewardManager needs a tokenizer to decode responses")
        responses, mask = batch["responses"], batch["response_mask"].bool()
        n = len(batch)
        if "final_text" in batch:  # agent trajectories: the final model turn is the answer graded
            texts = list(batch["final_text"])
        else:
            texts = self.tokenizer.batch_decode([responses[i][mask[i]].tolist() for i in range(n)],
                                                skip_special_tokens=True)
        scores, metrics = self.score(
            texts, batch.get("ground_truth", [None] * n), batch.get("data_source", ["unknown"] * n)
        )
        return at_last_token(torch.tensor(scores, dtype=torch.float32), mask).to(responses.device), metrics

    def score(
        self, solutions: Sequence[str], ground_truths: Sequence[Any], data_sources: Sequence[str]
    ) -> tuple[list[float], dict[str, float]]:
        """Scores of decoded responses plus ``reward/errors`` and ``reward/timeouts`` counts."""
        if not len(solutions) == len(ground_truths) == len(data_sources):
            raise ValueError(f"score: {len(solutions)} solutions, {len(ground_truths)} ground truths, "
                             f"{len(data_sources)} data sources")
        targets = [self._target(ds) for ds in data_sources]
        results: dict[int, Any] = {}
        isolated = []
        for i, target in enumerate(targets):
            if not self.isolate or target in IN_PROCESS_SAFE:
                try:
                    results[i] = self._resolve(target)(solutions[i], ground_truths[i], **self.reward_kwargs)
                except Exception as e:  # noqa: BLE001 - a bad reward call is counted, not fatal
                    results[i] = e
            else:
                isolated.append(i)
        if isolated:
            jobs = [(i, targets[i], solutions[i], ground_truths[i]) for i in isolated]
            results.update(self._run_isolated(jobs))
        scores, errors, timeouts = [], 0, 0
        for i in range(len(solutions)):
            value = _as_score(results[i])
            if value is None:
                if results[i] is _TIMEOUT:
                    timeouts += 1
                    reason = f"timed out after {self.timeout_s}s"
                else:
                    errors += 1
                    reason = f"failed: {results[i]!r}"
                if errors + timeouts <= _MAX_LOGGED_ERRORS:
                    log.warning("reward for sample %d (data_source=%r) %s; scored %s",
                                i, data_sources[i], reason, self.on_error_score)
                value = self.on_error_score
            scores.append(value)
        return scores, {"reward/errors": float(errors), "reward/timeouts": float(timeouts)}

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ choosing functions
    @staticmethod
    def _check_target(target: RewardFn | str) -> RewardFn | str:
        if isinstance(target, str):
            load_reward_fn(target)  # fail now, with a clear error, rather than once per sample
            return target
        if not callable(target):
            raise ValueError(f"reward function must be callable or a 'pkg.mod:fn' / '/path/file.py:fn' string, got {target!r}")
        return target

    def _target(self, data_source: str) -> RewardFn | str:
        if data_source in self._per_source:
            return self._per_source[data_source]
        if self._default is not None:
            return self._default
        return get_reward_fn(data_source)

    def _resolve(self, target: RewardFn | str) -> RewardFn:
        if isinstance(target, str):
            if target not in self._loaded:
                self._loaded[target] = load_reward_fn(target)
            return self._loaded[target]
        return target

    # ------------------------------------------------------------------ worker processes
    def _run_isolated(self, jobs: list[tuple[int, Any, str, Any]]) -> dict[int, Any]:
        """Run ``(index, target, solution, ground_truth)`` jobs in the worker pool; timeouts -> ``_TIMEOUT``."""
        if self._pool is None:
            self._pool = IsolatedPool(self.num_workers, self.timeout_s, self.startup_timeout_s)
        results = self._pool.run([(target, (solution, truth), self.reward_kwargs) for _, target, solution, truth in jobs])
        for r in results:
            if isinstance(r, WorkerStartupError):
                raise r
        return {job[0]: _TIMEOUT if isinstance(r, CallTimeout) else r for job, r in zip(jobs, results)}


def _as_score(result: Any) -> float | None:
    """A finite float from a reward result (number, bool, or dict with 'score'); None if it is not one."""
    if isinstance(result, Mapping):
        result = result.get("score")
    if isinstance(result, torch.Tensor) and result.numel() == 1:
        result = result.item()
    if isinstance(result, (bool, int, float)) and not isinstance(result, BaseException):
        value = float(result)
        return value if math.isfinite(value) else None
    return None
