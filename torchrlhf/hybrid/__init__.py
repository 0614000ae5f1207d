"""The hybrid engine: train in the FSDP2 (× TP) layout, generate in the engine's TP × micro-DP layout.

`generation_mode` is the transition (weights streamed in by `iter_generation_weights`, training memory
released, restored on exit); `generation_mesh` is the HybridFlow rank grouping that makes it cheap.
"""

from torchrlhf.hybrid.layout import generation_mesh, suffix_tp_dims, training_mesh
from torchrlhf.hybrid.mode import generate_with_current_weights, generation_mode, resolve_generation_mesh
from torchrlhf.hybrid.reshard import ReshardStats, iter_generation_weights

__all__ = [
    "ReshardStats",
    "generate_with_current_weights",
    "generation_mesh",
    "generation_mode",
    "iter_generation_weights",
    "resolve_generation_mesh",
    "suffix_tp_dims",
    "training_mesh",
]
