from torchrlhf.data.batch import Batch

__all__ = ["Batch"]
