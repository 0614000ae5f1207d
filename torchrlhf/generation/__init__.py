"""Rollout generation: one engine interface (`RolloutEngine`), the native engine and the vLLM engine.

`VLLMEngine` imports vLLM only when constructed, so the package works without the `vllm` extra. The names below
are imported on first use: the agents implement `torchrlhf.generation.session`'s contract, and a tool worker
process that imports them must not pay for the engines (transformers, the compiled decode step): 2.5 s instead
of 9.8 s on a 2-core CPU host.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

_MODULE_OF = {
    "CAPABILITIES": "base",
    "RolloutEngine": "base",
    "assemble_generation": "base",
    "capability_errors": "base",
    "engine_problem": "base",
    "generate_in_rounds": "base",
    "NativeEngine": "engine",
    "SamplingParams": "sampling",
    "sample_tokens": "sampling",
    "VLLMEngine": "vllm_engine",
    "vllm_available": "vllm_engine",
}

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


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'torchrlhf.generation' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"torchrlhf.generation.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # imported once
    return value
