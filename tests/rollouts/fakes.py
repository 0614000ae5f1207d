"""A fake rollout group whose calls take random times, and numbered prompt batches: the schedules' tests
drive the library's rollout sources over them."""

from __future__ import annotations

import random
import threading
import time

import torch

from torchrlhf.data import Batch
from torchrlhf.generation import SamplingParams

N, B, R = 2, 4, 3  # samples per prompt, prompts per step, response width


class FakeFuture:
    def __init__(self) -> None:
        self._event, self._value = threading.Event(), None

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self):
        self._event.wait()
        return self._value


class FakeRollouts:
    """``call_dp`` answers after a random delay with n rows per prompt, recording the version asked for."""

    def __init__(self, dp_size: int, seed: int = 0, slow: float = 0.03) -> None:
        self.dp_size, self.rng, self.slow = dp_size, random.Random(seed), slow
        # one rank per replica: replica d on rank d + 1
        self.ranks, self.lost_dp_ranks, self.dead = [d + 1 for d in range(dp_size)], set(), set()
        self.running: dict[int, int] = {}
        self.max_running = 0
        self.lock = threading.Lock()
        self.calls: list[tuple[int, int]] = []  # (replica, version)
        self.seen: list[tuple[int, float, int]] = []  # (replica, temperature, version)

    def call_dp(self, d: int, method: str, prompts: Batch, sampling: SamplingParams, *, version: int,
                partial: bool = False) -> FakeFuture:
        assert method == "generate"
        with self.lock:
            self.running[d] = self.running.get(d, 0) + 1
            self.max_running = max(self.max_running, self.running[d])
            self.calls.append((d, version))
            self.seen.append((d, sampling.temperature, version))
        fut = FakeFuture()
        delay = self.slow * (10 if self.rng.random() < 0.2 else self.rng.random())  # a long tail

        def finish() -> None:
            time.sleep(delay)
            out = prompts.repeat(sampling.n)
            width = prompts["input_ids"].shape[1]
            out["prompts"] = out["input_ids"]
            out["responses"] = torch.ones(len(out), R, dtype=torch.long)
            out["response_mask"] = torch.ones(len(out), R, dtype=torch.long)
            out["input_ids"] = torch.cat([out["prompts"], out["responses"]], 1)
            out["attention_mask"] = torch.cat([out["attention_mask"], out["response_mask"]], 1)
            out["position_ids"] = torch.arange(width + R).expand(len(out), -1).clone()
            out["weight_version"] = torch.full((len(out),), version)  # as the rollout worker stamps it
            with self.lock:
                self.running[d] -= 1
            fut._value = out
            fut._event.set()

        threading.Thread(target=finish, daemon=True).start()
        return fut

    def generate(self, prompts: Batch, sampling: SamplingParams, *, version: int) -> Batch:
        """Colocated with the actor: one call over every rank (replica 0 answers for all)."""
        return self.call_dp(0, "generate", prompts, sampling, version=version).wait()

    def idle(self) -> bool:
        with self.lock:
            return all(v == 0 for v in self.running.values())

    # the part of `WorkerGroup` that loses replicas
    @property
    def live_dp_ranks(self) -> list[int]:
        return [d for d in range(self.dp_size) if d not in self.lost_dp_ranks]

    @property
    def live_ranks(self) -> list[int]:
        return [d + 1 for d in self.live_dp_ranks]

    def drop_dead(self, called: list[int]) -> bool:
        self.lost_dp_ranks |= self.dead
        return bool(set(called) - set(self.live_ranks))

    def busy_seconds(self) -> list[tuple[float, dict[str, float]]]:
        return [(time.monotonic(), {}) for _ in self.live_ranks]


class PromptSource:
    """Batches of B prompts numbered 0, 1, 2, ... (with widths that vary between batches)."""

    batch_size = B
    pad_id = 0

    def __init__(self) -> None:
        self.next = 0
        self.batches = 0

    def next_batch(self) -> Batch:
        width = 2 + self.batches % 3
        self.batches += 1
        ids = list(range(self.next, self.next + B))
        self.next += B
        return Batch({"input_ids": torch.full((B, width), 7), "attention_mask": torch.ones(B, width, dtype=torch.long)},
                     {"index": ids})
