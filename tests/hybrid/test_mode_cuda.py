"""`generation_mode` on an accelerator: the actor's optimizer state leaves the device while the engine
generates, unless ``offload=False`` (``rollout.offload_optimizer``) keeps it there."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.hybrid import generation_mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class _Engine:
    tp_size, tp_mesh = 1, None

    def resume(self, tags=("weights", "kv_cache")):
        pass

    def release(self):
        pass

    def update_weights(self, named_tensors):
        for _ in named_tensors:
            pass

    def param_shard_dims(self):
        return {}


@pytest.mark.parametrize("offload", [True, False])
def test_the_optimizer_state_leaves_the_device_during_generation_only_when_offloaded(offload):
    model = torch.nn.Linear(64, 32, device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    opt.step()
    moments = [v for st in opt.state.values() for k, v in st.items() if k != "step"]
    before = [v.clone() for v in moments]
    with generation_mode(model, _Engine(), optimizer=opt, offload=offload):
        held = [v.untyped_storage().nbytes() for v in moments]
        assert all(n == 0 for n in held) if offload else all(n > 0 for n in held)
    assert all(torch.equal(a, b) for a, b in zip(moments, before))
