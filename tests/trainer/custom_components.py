"""User-style subclasses for ``_component_`` tests (importable on every rank through PYTHONPATH)."""

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
    def update(self, batch):
        metrics = super().update(batch)
        metrics["actor/marker"] = self.marker
        return metrics


class NotAWorker:
    def __init__(self, model_path: str):
        self.model_path = model_path
