"""ComputeCopies: bf16 compute copies of float32 weights, gradients summed into float32 masters."""

from __future__ import annotations

import torch
from torch import nn

from torchrlhf.models.compute_copies import ComputeCopies


class _Tied(nn.Module):
    """An embedding whose weight is also the output projection (as a tied LM head), and a frozen scale."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.scale = nn.Parameter(torch.full((3,), 2.0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) * self.scale)


def test_copies_compute_in_bf16_and_sum_gradients_into_the_float32_masters():
    torch.manual_seed(0)
    model = _Tied()
    copies = ComputeCopies(model, torch.bfloat16)
    w32 = model.embed.weight
    ids, g = [torch.tensor([0, 3]), torch.tensor([4, 4])], [torch.randn(2, 5), torch.randn(2, 5)]
    with copies.active():
        assert model.embed.weight is model.head.weight and model.embed.weight.dtype == torch.bfloat16
        outs = []
        for i in range(2):  # two micro-batches
            out = model(ids[i])
            out.backward(g[i].to(torch.bfloat16))
            outs.append(out)
    assert model.embed.weight is w32 and w32.dtype == torch.float32  # the masters are back outside
    assert copies.nbytes() == (15 + 3) * 2
    # By hand, in bf16 as the copies compute: out = (W[ids] * s) W^T; dW = scatter(g W) * s + g^T (W[ids] * s).
    w = w32.detach().to(torch.bfloat16)
    want = torch.zeros(5, 3)
    for i in range(2):
        x = w[ids[i]] * 2.0
        torch.testing.assert_close(outs[i].detach(), x @ w.t(), atol=0, rtol=0)
        gb = g[i].to(torch.bfloat16)
        dw = (gb.t() @ x).float()
        dw.index_add_(0, ids[i], ((gb @ w) * 2.0).float())
        want += dw
    torch.testing.assert_close(w32.grad, want, atol=2e-2, rtol=1e-2)  # bf16 rounding of the two terms' sum
    assert w32.grad.dtype == torch.float32 and model.scale.grad is None


def test_copies_follow_every_write_to_the_masters():
    model = _Tied()
    copies = ComputeCopies(model, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)  # fused steps leave tensor versions alone
    for _ in range(2):
        with copies.active():
            model(torch.tensor([1, 2])).sum().backward()
        opt.step()
        opt.zero_grad()
        w32 = model.embed.weight.detach().clone()
        with copies.active():
            assert torch.equal(model.embed.weight.detach(), w32.to(torch.bfloat16))
    with torch.no_grad():
        model.embed.weight.fill_(0.25)
    with copies.active():
        assert torch.equal(model.embed.weight.detach(), torch.full((5, 3), 0.25, dtype=torch.bfloat16))
