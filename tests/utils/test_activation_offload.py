"""Saved tensors held on the host until backward: the same gradients, weights never copied, a clear limit."""

from __future__ import annotations

import pytest
import torch

from torchrlhf.utils.activation_offload import host_bytes_available, saved_tensors_on


def _loss(w: torch.nn.Parameter, x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)  # saves x and w for matmul, tanh's output
    return (h * h.sigmoid()).sum()


def test_gradients_are_unchanged_and_weights_stay_put():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    _loss(w, x).backward()
    want_w, want_x = w.grad.clone(), x.grad.clone()
    w.grad, x.grad = None, None
    with saved_tensors_on("cpu") as stats:
        loss = _loss(w, x)
    loss.backward()
    assert torch.equal(w.grad, want_w) and torch.equal(x.grad, want_x)
    # x (matmul), h (tanh's output), s (sigmoid's output), h and s (their product): 5 [4, 8] float32
    # tensors; not w, which matmul saves too (6 tensors and 256 more bytes if it were copied)
    assert stats.tensors == 5 and stats.bytes == 5 * 4 * 8 * 4


def test_more_than_the_limit_is_a_clear_error():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"offload_prefix_activations: the host memory this rank may use "
                                           r"\(0\.00 GiB.*1 tensors .* held, the next needs"):
        with saved_tensors_on("cpu", limit_bytes=200, what="offload_prefix_activations"):
            _loss(w, x)


def test_the_host_share_is_split_over_the_node_ranks(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = host_bytes_available()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert 0 < host_bytes_available() < one
