"""Scoring generated responses with rule / user reward functions under a time limit.

`RewardManager` turns a generation `Batch` into ``token_level_scores [B, R]`` (the sample's
score on its last response token, zeros elsewhere) and metrics. A reward function that
raises, returns a non-number, or runs past ``timeout_s`` scores ``on_error_score`` and is
counted (``reward/errors``, ``reward/timeouts``); training goes on.

Where code runs: the bounded-cost built-ins (GSM8K, countdown, arithmetic) run in this
process. Everything else — user functions, sympy-based math — runs in a pool of worker
processes, because a hung Python call cannot be interrupted in a thread: on a timeout the
pool's processes are killed and a fresh pool is started. User reward code runs with the
permissions of the user who launched training; only configure code you trust.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import pickle
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from torchrlhf.data.batch import Batch
from torchrlhf.rewards.registry import IN_PROCESS_SAFE, RewardFn, get_reward_fn, load_reward_fn

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
        self._default: RewardFn | str | None = None
        self._per_source: dict[str, RewardFn | str] = {}
        if isinstance(reward_fn, Mapping):
            self._per_source = {k: self._check_target(v) for k, v in reward_fn.items()}
        elif reward_fn is not None:
            self._default = self._check_target(reward_fn)
        self._loaded: dict[str, RewardFn] = {}
        self._pool: ProcessPoolExecutor | None = None

    # ------------------------------------------------------------------ public
    def __call__(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """(``token_level_scores [B, R]`` float32, metrics) for a generation batch."""
        if self.tokenizer is None:
            raise ValueError("RewardManager needs a tokenizer to decode responses")
        responses, mask = batch["responses"], batch["response_mask"].bool()
        n = len(batch)
        ids = [responses[i][mask[i]].tolist() for i in range(n)]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        scores, metrics = self.score(
            texts, batch.get("ground_truth", [None] * n), batch.get("data_source", ["unknown"] * n)
        )
        token_scores = torch.zeros(responses.shape, dtype=torch.float32)
        last = (mask.sum(-1) - 1).clamp(min=0).cpu()
        token_scores[torch.arange(n), last] = torch.tensor(scores, dtype=torch.float32)
        return token_scores.to(responses.device), metrics

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
            self._kill_pool()

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
        """Run jobs with at most ``num_workers`` in flight, so each starts as soon as it is submitted."""
        for _, target, _, _ in jobs:
            if not isinstance(target, str):
                try:
                    pickle.dumps(target)
                except Exception as e:  # noqa: BLE001
                    raise ValueError(
                        f"reward function {target!r} cannot be sent to a worker process ({e}); define it at module "
                        "level, pass it as 'pkg.mod:fn' or '/path/file.py:fn', or use isolate=False"
                    ) from e
        results: dict[int, Any] = {}
        queue = deque(jobs)
        inflight: dict[Future, tuple[tuple[int, Any, str, Any], float]] = {}
        while queue or inflight:
            pool = self._get_pool()
            while queue and len(inflight) < self.num_workers:
                job = queue.popleft()
                fut = pool.submit(_call_reward, job[1], job[2], job[3], self.reward_kwargs)
                inflight[fut] = (job, time.monotonic() + self.timeout_s)
            nearest = min(deadline for _, deadline in inflight.values())
            done, _ = wait(list(inflight), timeout=max(0.0, nearest - time.monotonic()), return_when=FIRST_COMPLETED)
            broken = False
            for fut in done:
                job, _ = inflight.pop(fut)
                exc = fut.exception()
                results[job[0]] = exc if exc is not None else fut.result()
                broken |= isinstance(exc, BrokenProcessPool)
            now = time.monotonic()
            expired = [f for f, (_, deadline) in inflight.items() if deadline <= now]
            if expired or broken:
                for fut in expired:
                    results[inflight.pop(fut)[0][0]] = _TIMEOUT
                # Killing the pool also stops the calls running beside the hung one: run those again.
                for fut, (job, _) in inflight.items():
                    queue.appendleft(job)
                inflight.clear()
                self._kill_pool()
        return results

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=self.num_workers, mp_context=_mp_context(), initializer=_init_worker,
                initargs=(sys.path, os.getpid()),
            )
            # Wait until every worker answers, so start-up does not count against a call's time limit.
            seen: set[int] = set()
            deadline = time.monotonic() + self.startup_timeout_s
            while len(seen) < self.num_workers:
                pings = [self._pool.submit(_ping) for _ in range(self.num_workers)]
                done, pending = wait(pings, timeout=max(0.0, deadline - time.monotonic()))
                if pending or any(f.exception() for f in done):
                    self._kill_pool()
                    raise RuntimeError(f"reward worker processes did not start within {self.startup_timeout_s}s")
                seen.update(f.result() for f in done)
        return self._pool

    def _kill_pool(self) -> None:
        pool, self._pool = self._pool, None
        processes = list((getattr(pool, "_processes", None) or {}).values())
        for p in processes:
            p.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            p.join(timeout=5)


_WORKER_FNS: dict[str, RewardFn] = {}


def _mp_context() -> multiprocessing.context.BaseContext:
    # forkserver: after a timeout kills the pool, new workers fork from a server that has already
    # imported this module (and torch), instead of paying the imports again as spawn would.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
        return ctx
    return multiprocessing.get_context("spawn")


def _init_worker(sys_path: list[str], owner: int) -> None:
    # The forkserver may have started before the caller extended sys.path: use the caller's path.
    sys.path[:] = list(sys_path)
    torch.set_num_threads(1)
    threading.Thread(target=_exit_after, args=(owner,), daemon=True, name="reward-owner-watch").start()


def _exit_after(owner: int) -> None:
    """End this worker once ``owner`` (the process that made the pool) has exited. A SIGKILLed rank gets no
    shutdown: its workers would wait on their queue forever and keep the forkserver alive, so a job that
    torchrun restarts would leave them behind at every restart."""
    try:
        fd = os.pidfd_open(owner)
        select.select([fd], [], [])  # readable once the owner has exited
    except (AttributeError, OSError):  # no pidfd here (not Linux, an old kernel), or the owner is gone: poll
        while True:
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # alive, under another user
                pass
            time.sleep(2.0)
    os._exit(1)


def _ping() -> int:
    time.sleep(0.05)  # long enough that one fast worker cannot answer every ping
    return os.getpid()


def _call_reward(target: RewardFn | str, solution: str, ground_truth: Any, kwargs: dict[str, Any]) -> Any:
    """Runs in a worker process: load the function once per process, then call it."""
    if isinstance(target, str):
        if target not in _WORKER_FNS:
            _WORKER_FNS[target] = load_reward_fn(target)
        target = _WORKER_FNS[target]
    return target(solution, ground_truth, **kwargs)


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
