"""The rollout schedules against a fake rollout group whose calls take random times.

What must hold whatever the timing: no sample trains more than ``max_staleness`` versions after the weights
that generated it; every prompt is trained exactly once (requeue) or counted as dropped; a replica never
runs two calls at once; ``paused`` means no call runs; the deterministic schedule gives batch t version
max(0, t - k) and the sampler's t-th batch.
"""

from __future__ import annotations

import time

import pytest
import torch

from torchrlhf.data import Batch
from torchrlhf.generation import SamplingParams
from torchrlhf.rollouts import (DeterministicRollouts, GroupFilter, Repack, Replicas, RolloutPipeline, Scorer,
                                StreamRollouts)
from torchrlhf.generation.base import left_pad_prompts
from torchrlhf.rollouts.batches import concat_prompts
from torchrlhf.runtime import WorkerError

from fakes import B, LONG, N, R, SHORT, FakeFuture, FakeRollouts, PromptSource, RepackingRollouts, fake_token


def _score(gen: Batch):
    return torch.zeros(len(gen), R), {"reward/mean": 0.0}


def _driver(cls, group, k: int, *, reward_fn=_score, n: int = N, remax: bool = False, max_filtered: int | None = None,
            lose_replicas: bool = False, **kwargs):
    """A schedule over the fake group, with the library's pipeline (scoring, ReMax, the group filter)."""
    group_filter = GroupFilter(n, max_filtered) if max_filtered is not None else None
    pipeline = RolloutPipeline(Scorer(reward_fn, max_tokens=R), SamplingParams(n=n, temperature=1.0, max_tokens=R),
                               remax=remax, group_filter=group_filter)
    replicas = Replicas(group, colocated=False, pad_id=0, lose_replicas=lose_replicas)
    return cls(pipeline, replicas, PromptSource(), max_staleness=k, seed=0, **kwargs)


@pytest.mark.parametrize("k,policy", [(1, "requeue"), (2, "requeue"), (1, "drop"), (0, "requeue")])
def test_stream_bounds_staleness_and_trains_each_prompt_once(k, policy):
    group = FakeRollouts(dp_size=3)
    driver = _driver(StreamRollouts, group, k, prompts_per_call=1, stale_policy=policy)
    driver.start(0)
    trained: list[int] = []
    try:
        for version in range(12):
            batch, metrics = driver.next_batch(version + 1, version)
            assert len(batch) == B * N
            lag = version - batch["weight_version"]
            assert int(lag.max()) <= k and int(lag.min()) >= 0, lag
            trained += batch["index"][::N]
            if version == 5:
                with driver.paused():
                    assert group.idle()
            time.sleep(0.01)  # "training"
            driver.publish(version + 1)
    finally:
        driver.stop()
    assert group.max_running == 1  # one call per replica at a time
    assert len(trained) == len(set(trained)) == 12 * B  # no prompt trained twice
    if policy == "requeue":
        assert driver.counters["dropped_groups"] == 0
    else:
        assert driver.counters["requeued_groups"] == 0
    assert {v for _, v in group.calls} <= set(range(13))



def _score_by_index(gen: Batch):
    """Prompts with an even index get rewards that differ within the group; odd ones get equal rewards."""
    index = torch.tensor(gen["index"])
    varied = (index % 2 == 0).float()[:, None] * torch.arange(len(gen)).float()[:, None] % N
    return torch.zeros(len(gen), R) + varied * (torch.arange(R) == R - 1), {}


def test_stream_dynamic_sampling_trains_only_informative_groups():
    group = FakeRollouts(dp_size=2, slow=0.01)
    driver = _driver(StreamRollouts, group, 1, reward_fn=_score_by_index, max_filtered=10 * B, prompts_per_call=1,
                     stale_policy="requeue")
    driver.start(0)
    dropped = 0
    try:
        for version in range(6):
            batch, metrics = driver.next_batch(version + 1, version)
            assert len(batch) == B * N
            assert all(i % 2 == 0 for i in batch["index"])  # the constant-reward groups never reach training
            assert int((version - batch["weight_version"]).max()) <= 1
            dropped += metrics["train/dropped_groups"]
            driver.publish(version + 1)
        assert dropped >= 6 * B - 2  # about one odd prompt per even one (a few may still be in flight)
        assert driver.counters["filtered_groups"] >= dropped
    finally:
        driver.stop()


def test_stream_dynamic_sampling_gives_up_when_every_group_is_constant():
    group = FakeRollouts(dp_size=2, slow=0.001)
    driver = _driver(StreamRollouts, group, 1, max_filtered=8, prompts_per_call=2,
                     stale_policy="requeue")  # _score: all rewards 0
    driver.start(0)
    try:
        with pytest.raises(RuntimeError, match=r"dynamic sampling: (9|10) prompt groups with constant rewards .*more than 8"):
            driver.next_batch(1, 0)
    finally:
        driver.stop()


def test_stream_remax_generates_each_greedy_baseline_on_the_same_replica_and_version():
    """ReMax: every call is followed by a greedy call with the same prompts, replica and relay version; the
    baseline of each sample is the score of its prompt's greedy response."""
    group = FakeRollouts(dp_size=2, slow=0.005)

    def by_index(gen: Batch):  # a greedy response scores 10 x its prompt's index
        scores = torch.zeros(len(gen), R)
        scores[:, -1] = torch.tensor(gen["index"], dtype=torch.float32) * 10
        return scores, {}

    driver = _driver(StreamRollouts, group, 1, reward_fn=by_index, n=1, remax=True, prompts_per_call=2,
                     stale_policy="requeue")
    driver.start(0)
    try:
        for version in range(4):
            batch, _ = driver.next_batch(version + 1, version)
            assert batch["reward_baselines"].tolist() == [10.0 * i for i in batch["index"]]
            driver.publish(version + 1)
    finally:
        driver.stop()
    seen = group.seen
    sampled = [i for i, (_, t, _) in enumerate(seen) if t == 1.0]
    for i in sampled[:-2]:  # the last calls may still have been sampling when the driver stopped
        greedy = next(j for j in range(i + 1, len(seen)) if seen[j][0] == seen[i][0])
        assert seen[greedy][1] == 0.0 and seen[greedy][2] == seen[i][2]


def test_stream_concatenates_prompts_of_different_widths():
    gen = Batch({"prompts": torch.tensor([[5, 6]]), "input_ids": torch.tensor([[5, 6, 9]]),
                 "attention_mask": torch.tensor([[1, 1, 1]]), "position_ids": torch.tensor([[0, 1, 2]]),
                 "responses": torch.tensor([[9]])})
    padded = left_pad_prompts(gen, 4, pad_id=0)
    assert padded["prompts"].tolist() == [[0, 0, 5, 6]]
    assert padded["input_ids"].tolist() == [[0, 0, 5, 6, 9]]
    assert padded["attention_mask"].tolist() == [[0, 0, 1, 1, 1]]
    assert padded["position_ids"].tolist() == [[0, 0, 0, 1, 2]]
    assert padded["responses"].tolist() == [[9]]



def test_prompt_batches_of_different_widths_concatenate_without_their_seeds():
    """Requeued prompts rejoin fresh ones: left-padded to the widest, seeds dropped (each call draws new)."""
    a = Batch({"input_ids": torch.tensor([[7]]), "attention_mask": torch.tensor([[1]]), "seed": torch.tensor([3])},
              {"answer": ["a"]})
    b = Batch({"input_ids": torch.tensor([[2, 8, 9]]), "attention_mask": torch.tensor([[0, 1, 1]])}, {"answer": ["b"]})
    both = concat_prompts([a, b], pad_id=2)
    assert both["input_ids"].tolist() == [[2, 2, 7], [2, 8, 9]]
    assert both["attention_mask"].tolist() == [[0, 0, 1], [0, 1, 1]]
    assert "seed" not in both and both.non_tensors["answer"] == ["a", "b"]

@pytest.mark.parametrize("k,warmup", [(0, 0), (1, 0), (2, 0), (1, 2)])
def test_deterministic_batch_t_uses_version_t_minus_k(k, warmup):
    """Batch t: the actor's weights after step t - k, i.e. version max(0, t - k - warmup) when the first
    ``warmup`` steps (critic_warmup) do not update the actor."""
    group = FakeRollouts(dp_size=2)
    driver = _driver(DeterministicRollouts, group, k, warmup=warmup)
    driver.start(0)
    try:
        for step in range(6):
            batch, _ = driver.next_batch(step + 1, max(0, step - warmup))
            assert batch["weight_version"].tolist() == [max(0, step - k - warmup)] * (B * N)
            assert batch["index"][::N] == list(range(step * B, (step + 1) * B))  # the sampler's step-th batch
            assert len(driver._ready) <= k + warmup  # never further ahead than the weights allow
            driver.publish(max(0, step + 1 - warmup))
    finally:
        driver.stop()


def test_stream_keeps_going_through_steps_without_an_update():
    """critic_warmup: the first steps publish the same version; admission counts steps, not versions, so
    the stream neither stalls nor runs ahead more than k + 1 batches."""
    group = FakeRollouts(dp_size=2, slow=0.005)
    driver = _driver(StreamRollouts, group, 1, prompts_per_call=1, stale_policy="requeue")
    driver.start(0)
    try:
        for step in range(8):
            version = max(0, step - 3)  # three warmup steps
            batch, _ = driver.next_batch(step + 1, version)
            assert len(batch) == B * N and int((version - batch["weight_version"]).max()) <= 1
            with driver._cond:
                assert driver._outstanding() <= driver.k * B  # the open step's batch is out already
            driver.publish(max(0, step + 1 - 3))
    finally:
        driver.stop()


def test_a_failing_rollout_call_reaches_the_trainer():
    class Broken(FakeRollouts):
        def call_dp(self, d, method, prompts, sampling, **kwargs):
            fut = FakeFuture()
            fut.wait = lambda: (_ for _ in ()).throw(RuntimeError("rank 2 died"))
            fut._event.set()
            return fut

    driver = _driver(StreamRollouts, Broken(dp_size=1), 1, prompts_per_call=1, stale_policy="requeue")
    driver.start(0)
    try:
        with pytest.raises(RuntimeError, match="asynchronous rollouts failed: rank 2 died"):
            driver.next_batch(1, 0)
    finally:
        driver.stop()


class Dying(FakeRollouts):
    """Replica 1's process dies during its 3rd call; later calls to it would fail the same way. With
    ``timeout``, its call fails the same way but the rank still answers (a timeout, not a death)."""

    def __init__(self, *args, timeout: bool = False, peer_error: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.timeout, self.calls_to_1, self.prompts_lost = timeout, 0, []
        self.peer_error = peer_error  # the failure comes as an exception from a live TP peer of the dead rank

    def call_dp(self, d, method, prompts, sampling, **kwargs):
        if d == 1:
            self.calls_to_1 += 1
            if self.calls_to_1 >= 3:
                if not self.timeout:
                    self.dead.add(1)
                self.prompts_lost += prompts["index"]
                fut = FakeFuture()
                error = (WorkerError("rollout", method, 2, "gloo: connection closed by peer") if self.peer_error
                         else WorkerError("rollout", method, 2, "rank 2 did not answer", unreachable=True))
                fut.wait = lambda: (_ for _ in ()).throw(error)
                fut._event.set()
                return fut
        return super().call_dp(d, method, prompts, sampling, **kwargs)


@pytest.mark.parametrize("peer_error", [False, True])
def test_stream_drops_a_dead_replica_and_requeues_its_prompts(peer_error):
    """The replica's call fails as the dead rank's (no answer) or, with TP, as its live peer's exception."""
    group = Dying(dp_size=3, slow=0.005, peer_error=peer_error)
    driver = _driver(StreamRollouts, group, 1, lose_replicas=True, prompts_per_call=2, stale_policy="requeue")
    driver.start(0)
    trained: list[int] = []
    try:
        for version in range(6):
            batch, metrics = driver.next_batch(version + 1, version)
            trained += batch["index"][::N]
            driver.publish(version + 1)
    finally:
        driver.stop()
    assert group.lost_dp_ranks == {1} and group.calls_to_1 == 3  # never called again once lost
    assert metrics["async/lost_rollout_ranks"] == 1.0
    assert metrics["async/requeued_in_flight"] == 2.0
    assert set(group.prompts_lost) <= set(trained)  # its prompts were generated elsewhere and trained
    assert len(trained) == len(set(trained)) == 6 * B


@pytest.mark.parametrize("lose_replicas,timeout", [(False, False), (True, True)])
def test_a_lost_replica_ends_the_run_unless_allowed_and_dead(lose_replicas, timeout):
    """Not allowed (e.g. rollout.tp_size > 1), or the rank still answers: the run ends with the error."""
    driver = _driver(StreamRollouts, Dying(dp_size=2, slow=0.005, timeout=timeout), 1, lose_replicas=lose_replicas,
                     prompts_per_call=1, stale_policy="requeue")
    driver.start(0)
    try:
        with pytest.raises(RuntimeError, match="rank 2 did not answer"):
            for version in range(6):
                driver.next_batch(version + 1, version)
                driver.publish(version + 1)
    finally:
        driver.stop()


@pytest.mark.parametrize("lose_replicas", [True, False])
def test_deterministic_generates_a_dead_replicas_batch_again_on_the_survivors(lose_replicas):
    """Replica 1 dies in its 3rd call (batch 2): the whole batch goes again to replica 0, with the scheduled
    version, and every later batch runs there; not allowed, the run ends with the error."""
    group = Dying(dp_size=2, slow=0.005)
    driver = _driver(DeterministicRollouts, group, 1, lose_replicas=lose_replicas)
    driver.start(0)
    try:
        if not lose_replicas:
            with pytest.raises(RuntimeError, match="rank 2 did not answer"):
                for step in range(6):
                    driver.next_batch(step + 1, step)
                    driver.publish(step + 1)
            return
        for step in range(6):
            batch, metrics = driver.next_batch(step + 1, step)
            assert batch["index"][::N] == list(range(step * B, (step + 1) * B))  # the sampler's step-th batch
            assert batch["weight_version"].tolist() == [max(0, step - 1)] * (B * N)
            driver.publish(step + 1)
    finally:
        driver.stop()
    assert group.lost_dp_ranks == {1} and group.calls_to_1 == 3  # never called again once lost
    assert metrics["async/lost_rollout_ranks"] == 1.0 and metrics["async/requeued_in_flight"] == float(B)
    assert group.max_running == 1  # replica 0 finished its share before the batch went to it again


def test_deterministic_checkpoint_pause_first_generates_what_the_new_version_allows():
    """A checkpoint right after a publish (the race that once hung a run): the pause waits for the batch
    the new version allows, so the saved state holds it and a resume continues exactly."""
    group = FakeRollouts(dp_size=2)
    driver = _driver(DeterministicRollouts, group, 1)
    driver.start(0)
    try:
        for step in range(4):
            driver.next_batch(step + 1, step)
            driver.publish(step + 1)
            with driver.paused(drain=True):
                state = driver.state_dict()
                assert group.idle()
            assert state["next_index"] == step + 3  # batches 0 .. (step + 1) + k
            assert sorted(state["ready"]) == [step + 1, step + 2]
            with driver.paused():  # validation's pause: nothing to wait for
                assert group.idle()
    finally:
        driver.stop()


# ---------------------------------------------------------------------------- repack (Laminar)


def _repack_driver(group, k: int, *, partial: bool = False, **kwargs):
    pipeline = RolloutPipeline(Scorer(_score_long, max_tokens=LONG), SamplingParams(n=N, temperature=1.0, max_tokens=LONG))
    replicas = Replicas(group, colocated=False, pad_id=0, lose_replicas=kwargs.pop("lose_replicas", False))
    repack = Repack(N, 0.25, 1, partial=partial)
    return StreamRollouts(pipeline, replicas, PromptSource(), max_staleness=k, seed=0, repack=repack,
                          prompts_per_call=2, stale_policy="requeue", partial_rollout=partial, **kwargs)


def _score_long(gen: Batch):
    return torch.zeros(len(gen), LONG), {"reward/mean": 0.0}


@pytest.mark.parametrize("k,partial", [(1, False), (2, False), (1, True)])
def test_repack_trains_every_sample_once_whole_and_with_its_version(k, partial):
    """Long samples are handed back after SHORT tokens and continued on the long-tail replica: every prompt
    trains once, each sample whole (every token and log-prob that of its own (prompt, sample, position), the
    carried ones as they came), with the version its group started with, within the staleness bound; a
    continuation runs with its samples' version (partial rollouts: at least it)."""
    group = RepackingRollouts(dp_size=3, slow=0.01)
    driver = _repack_driver(group, k, partial=partial)
    driver.start(0)
    trained, counts, occupancy = [], [], []
    try:
        for version in range(8):
            batch, metrics = driver.next_batch(version + 1, version)
            assert len(batch) == B * N
            lag = version - batch["weight_version"]
            assert int(lag.max()) <= k and int(lag.min()) >= 0, lag
            for r in range(len(batch)):
                index, sample = batch["index"][r], r % N
                length = LONG if (index + sample) % 5 == 0 else SHORT
                assert int(batch["response_mask"][r].sum()) == length
                expected = torch.tensor([fake_token(index, sample, t) for t in range(length)])
                assert torch.equal(batch["responses"][r, :length], expected), (index, sample)
                assert torch.allclose(batch["rollout_log_probs"][r, :length], -expected.float() / 100)
                assert batch["finish_reason"][r] == "length"
            trained += batch["index"][::N]
            counts.append(metrics["rollout/repacked/count"])
            occupancy.append(metrics.get("rollout/occupancy/mean"))  # absent when no call ended since the last step
            assert 0 <= metrics["rollout/repacked/long_tail_token_share"] <= 1
            if version == 4:
                with driver.paused():
                    assert group.idle()
                    pending = len(driver.state_dict()["pending"])
                    assert pending >= driver.repack.open_groups()  # open groups are generated again on resume
            driver.publish(version + 1)
    finally:
        driver.stop()
    assert group.max_running == 1
    assert len(trained) == len(set(trained)) == 8 * B
    assert all(0 < o <= 1 for o in occupancy if o is not None) and any(o is not None for o in occupancy)
    assert group.released > 0 and sum(counts) > 0 and group.continued
    for d, asked, versions in group.continued:
        assert d == 2  # the long-tail replica
        assert (asked >= max(versions)) if partial else all(v == asked for v in versions)


def test_repack_continues_on_the_others_once_the_long_tail_replica_is_lost():
    """The long-tail replica dies: what it was continuing waits again, and the surviving replicas continue it."""

    class DyingTail(RepackingRollouts):
        def call_dp(self, d, method, prompts, sampling=None, **kwargs):
            if d == 2 and method == "generate" and "carried_tokens" in prompts:  # dies in its first continuation
                self.dead.add(2)
                fut = FakeFuture()
                error = WorkerError("rollout", method, 3, "rank 3 did not answer", unreachable=True)
                fut.wait = lambda: (_ for _ in ()).throw(error)
                fut._event.set()
                return fut
            return super().call_dp(d, method, prompts, sampling, **kwargs)

    group = DyingTail(dp_size=3, slow=0.005)
    driver = _repack_driver(group, 1, lose_replicas=True)
    driver.start(0)
    trained = []
    try:
        for version in range(6):
            batch, metrics = driver.next_batch(version + 1, version)
            for r in range(len(batch)):
                index, sample = batch["index"][r], r % N
                length = LONG if (index + sample) % 5 == 0 else SHORT
                assert int(batch["response_mask"][r].sum()) == length
            trained += batch["index"][::N]
            driver.publish(version + 1)
    finally:
        driver.stop()
    assert group.lost_dp_ranks == {2}
    assert len(trained) == len(set(trained)) == 6 * B
    assert group.continued and all(d != 2 for d, _, _ in group.continued)  # the survivors took over
