"""Rollout generation: one engine interface (`RolloutEngine`), the native engine and the vLLM engine.

`VLLMEngine` imports vLLM only when constructed, so the package works without the `vllm` extra.
"""

from torchrlhf.generation.base import (
    CAPABILITIES,
    RolloutEngine,
    assemble_generation,
    capability_errors,
    engine_problem,
    generate_in_rounds,
)
from torchrlhf.generation.engine import NativeEngine
from torchrlhf.generation.sampling import SamplingParams, sample_tokens
from torchrlhf.generation.vllm_engine import VLLMEngine, vllm_available

__all__ = [
    "CAPABILITIES",
    "NativeEngine",
    "RolloutEngine",
    "SamplingParams",
    "VLLMEngine",
    "assemble_generation",
    "capability_errors",
    "engine_problem",
    "generate_in_rounds",
    "sample_tokens",
    "vllm_available",
]
