"""A fake rollout group whose calls take random times, and numbered prompt batches: the schedules' tests
drive the library's rollout sources over them."""

from __future__ import annotations

import random
import threading
import time

import torch

from torchrlhf.data import Batch
from torchrlhf.generation import SamplingParams
from torchrlhf.generation.base import CARRIED_COLUMNS, concat_generations

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


LONG, SHORT = 8, 2  # response lengths of the repack fake: sample j of prompt i is long when (i + j) % 5 == 0


def fake_token(index: int, sample: int, t: int) -> int:
    """The token sample ``sample`` of prompt ``index`` samples at position ``t``, wherever it runs."""
    return 3 + (index * 7 + sample * 3 + t) % 50


class RepackingRollouts(FakeRollouts):
    """An engine that repacks: with ``release_below`` a call stops once its short samples have ended and hands
    the long ones back after SHORT tokens (finish reason "carried"); a call of carried samples continues each
    from the columns it is given (tokens and log-probs so far, its sample index), as the native engine does.
    Every token and log-prob is a function of (prompt index, sample, position), so a wrongly reassembled or
    wrongly continued sample shows. ``continued`` records (replica, version asked, carried versions) per continuation."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.continued: list[tuple[int, int, list[int]]] = []
        self.released = self.joins = 0
        self.inbox: dict[int, list] = {}  # replica -> rows joined to its running call

    def call_dp(self, d, method, prompts, sampling=None, *, version=None, partial=False, release_below=None,
                joinable=False):
        if method == "join":  # carried samples join replica d's running call, if it still takes them
            fut = FakeFuture()
            with self.lock:
                inbox = self.inbox.get(d)
                if inbox is not None:
                    inbox.append(prompts)
                    self.joins += len(prompts)
            fut._value = inbox is not None
            fut._event.set()
            return fut
        assert method == "generate"
        carried = "carried_tokens" in prompts
        if joinable:
            with self.lock:
                self.inbox[d] = []
        if carried:
            assert sampling.n == 1
            with self.lock:
                self.continued.append((d, version, prompts["carried_versions"][:, 0].tolist()))
        with self.lock:
            self.running[d] = self.running.get(d, 0) + 1
            self.max_running = max(self.max_running, self.running[d])
            self.calls.append((d, version))
        fut = FakeFuture()
        delay = self.slow * self.rng.random()

        def finish() -> None:
            nonlocal prompts
            time.sleep(delay)
            if joinable:
                with self.lock:
                    joined = self.inbox.pop(d)
                if joined:
                    prompts = concat_generations([prompts, *joined], 0)
                    with self.lock:
                        self.continued.append((d, version, prompts["carried_versions"][:, 0].tolist()))
            rows = []
            for i in range(len(prompts)):
                for j in range(sampling.n):
                    index = prompts["index"][i]
                    sample = int(prompts["sample_index"][i]) if carried else j
                    length = LONG if (index + sample) % 5 == 0 else SHORT
                    start = int(prompts["carried_lengths"][i]) if carried else 0
                    stop = SHORT if release_below is not None and not carried and length > SHORT else length
                    rows.append((i, index, sample, start, stop, "carried" if stop < length else "length"))
            out = prompts.repeat(sampling.n)
            for c in CARRIED_COLUMNS:
                if c in out:
                    out.pop(c)
            responses = torch.zeros(len(rows), LONG, dtype=torch.long)
            logps = torch.zeros(len(rows), LONG)
            mask = torch.zeros(len(rows), LONG, dtype=torch.long)
            for r, (i, index, sample, start, stop, _) in enumerate(rows):
                for t in range(stop):
                    if t < start:  # kept as it came
                        responses[r, t] = prompts["carried_tokens"][i, t]
                        logps[r, t] = prompts["carried_log_probs"][i, t]
                    else:
                        responses[r, t] = fake_token(index, sample, t)
                        logps[r, t] = -fake_token(index, sample, t) / 100
                mask[r, :stop] = 1
            width = prompts["input_ids"].shape[1]
            out["prompts"] = out["input_ids"]
            out["responses"], out["response_mask"], out["rollout_log_probs"] = responses, mask, logps
            out["input_ids"] = torch.cat([out["prompts"], responses], 1)
            out["attention_mask"] = torch.cat([out["attention_mask"], mask], 1)
            out["position_ids"] = torch.arange(width + LONG).expand(len(out), -1).clone()
            out["weight_version"] = torch.full((len(out),), version)
            out["finish_reason"] = [r[-1] for r in rows]
            out.meta.update({"rollout/decode_steps": float(max(r[4] - r[3] for r in rows)),
                             "rollout/slot_steps": float(sum(r[4] - r[3] for r in rows)),
                             "rollout/slots": float(len(rows))})
            with self.lock:
                self.released += sum(r[-1] == "carried" for r in rows)
                self.running[d] -= 1
            fut._value = out
            fut._event.set()

        threading.Thread(target=finish, daemon=True).start()
        return fut
