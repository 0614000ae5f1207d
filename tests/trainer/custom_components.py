"""User-style subclasses for ``_component_`` tests (importable on every rank through PYTHONPATH), and a
user's advantage estimator: registering it here, with its traits, is all a new estimator takes."""

import os
import signal
import time

import torch

from torchrlhf.algorithms import ADV_ESTIMATORS, group_ids
from torchrlhf.generation import NativeEngine
from torchrlhf.rewards import RewardManager
from torchrlhf.runtime import Dispatch, register
from torchrlhf.workers import ActorWorker


class ShiftedRewardManager(RewardManager):
    """Adds ``score_shift`` to every score: visible in ``critic/score/mean``."""

    def __init__(self, *args, score_shift: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.score_shift = score_shift

    def score(self, solutions, ground_truths, data_sources):
        scores, metrics = super().score(solutions, ground_truths, data_sources)
        return [s + self.score_shift for s in scores], metrics


class MarkedActor(ActorWorker):
    """Reports its ``marker`` argument from `update`, proving the recipe built this class on the workers."""

    def __init__(self, *args, marker: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.marker = marker

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch, **kwargs):
        metrics = super().update(batch, **kwargs)
        metrics["actor/marker"] = self.marker
        return metrics


class NotAWorker:
    def __init__(self, model_path: str):
        self.model_path = model_path


class DyingEngine(NativeEngine):
    """A rollout engine whose process dies (SIGKILL, as the OOM killer would) on rank ``die_on_rank``.

    ``die_at_generate``: at the start of its n-th generate call (1-based), i.e. with prompts in flight.
    ``die_in_first_sync``: when asked for its parameter layout, which a rollout rank does when it makes its
    weight relay inside the first asynchronous weight sync, i.e. in the middle of a broadcast.
    ``die_in_greedy``: at its first greedy call (temperature 0: validation).
    """

    def __init__(self, *args, die_on_rank: int = -1, die_at_generate: int = 0, die_in_first_sync: bool = False,
                 die_in_greedy: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self._dies = torch.distributed.get_rank() == die_on_rank
        self._die_at_generate, self._die_in_first_sync, self._calls = die_at_generate, die_in_first_sync, 0
        self._die_in_greedy = die_in_greedy

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def generate(self, prompts, sampling=None, **kwargs):
        self._calls += 1
        greedy = sampling is not None and sampling.temperature == 0
        if self._dies and (self._calls == self._die_at_generate or (self._die_in_greedy and greedy)):
            self._die()
        return super().generate(prompts, sampling, **kwargs)

    def param_shard_dims(self):
        if self._dies and self._die_in_first_sync:
            self._die()
        return super().param_shard_dims()


class SlowEngine(NativeEngine):
    """Sleeps ``step_delay_s`` before each step of a partial rollout: generations that outlast a training
    step, as long ones do, so new weights arrive mid-trajectory."""

    def __init__(self, *args, step_delay_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_delay_s = step_delay_s

    def generate(self, prompts, sampling=None, *, between_steps=None, **kwargs):
        if between_steps is None:
            return super().generate(prompts, sampling, **kwargs)

        def slowly() -> int:
            time.sleep(self.step_delay_s)
            return between_steps()

        return super().generate(prompts, sampling, between_steps=slowly, **kwargs)


class SingleTurnEngine(NativeEngine):
    """An engine that declares no capability beyond single-turn sampling."""

    capabilities = frozenset()


class StaleEngine(NativeEngine):
    """Overrides generate without the arguments of the capabilities it inherits."""

    def generate(self, prompts, sampling=None):
        return super().generate(prompts, sampling)


class KillOnceActor(ActorWorker):
    """An actor whose process on rank ``kill_rank`` SIGKILLs itself at its ``kill_at_update``-th update, once.

    ``marker`` is a file written just before the kill: the restarted job finds it and trains on. Rank 0's
    process is the controller too, so ``kill_rank=0`` kills the controller.
    """

    def __init__(self, *args, kill_rank: int = -1, kill_at_update: int = 1, marker: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._kill = torch.distributed.get_rank() == kill_rank and not os.path.exists(marker)
        self._kill_at_update, self._marker, self._updates = kill_at_update, marker, 0

    @register(dispatch=Dispatch.DP_COMPUTE)
    def update(self, batch, **kwargs):
        self._updates += 1
        if self._kill and self._updates == self._kill_at_update:
            with open(self._marker, "w") as f:
                f.write(f"killed rank {torch.distributed.get_rank()} at update {self._updates}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().update(batch, **kwargs)


class CountingEnv:
    """A multi-turn environment for agent runs: three model turns, reward 0.5 a turn, observations name the turn."""

    def reset(self, row):
        self.turns = 0
        return None  # the data row's prompt is the first context

    def step(self, text):
        self.turns += 1
        return f"turn {self.turns} done", 0.5, self.turns >= 3


@ADV_ESTIMATORS.register("best_of_group", group=True)
def best_of_group_advantage(token_level_rewards, response_mask, *, index, **_):
    """+1 for the best response of each prompt's group (the first on a tie), -1/(n-1) for the n-1 others:
    the advantages of a group sum to 0. ``group=True``: the trainer passes ``index`` (the batch's ``uid``)."""
    mask = response_mask.float()
    scores = (token_level_rewards.float() * mask).sum(-1)
    gid = group_ids(index, len(scores), scores.device)
    adv = torch.zeros_like(scores)
    for g in gid.unique():
        members = (gid == g).nonzero().squeeze(-1)
        adv[members] = -1.0 / max(len(members) - 1, 1)
        adv[members[torch.argmax(scores[members])]] = 1.0
    adv = adv.unsqueeze(-1) * mask
    return adv, adv
