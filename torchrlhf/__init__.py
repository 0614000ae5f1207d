"""torchrlhf: PyTorch-native RLHF on the HybridFlow single-controller design."""

__version__ = "0.1.0"
