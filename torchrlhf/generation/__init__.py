"""Rollout generation: the native KV-cached, continuously batched engine."""

from torchrlhf.generation.engine import NativeEngine
from torchrlhf.generation.sampling import SamplingParams, sample_tokens

__all__ = ["NativeEngine", "SamplingParams", "sample_tokens"]
