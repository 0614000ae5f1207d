"""Model FLOPs of a decoder-only transformer pass, and the matmul peak they are compared with (MFU).

MFU (model FLOPs utilisation) = FLOPs the model's math needs for the tokens a pass processed / (the
pass's seconds × the device's peak FLOP/s). Counted per forward, over the tokens actually processed
(padding excluded):

    2 · P_blocks · tokens  +  4 · L · H · d_head · keys  +  2 · D · V_out · scored

- ``P_blocks``: the weights of every Linear inside the transformer blocks (q, k, v, o, gate, up, down),
  so each token costs 2 FLOPs per weight (a multiply and an add); in a mixture-of-experts block, the router
  and the ``top_k`` experts a token runs (its *active* weights, `models.moe.active_expert_params`);
- ``keys``: the sum over the processed tokens of the keys each one attends to, itself included (a causal
  token at position t of a sequence, after c shared prompt tokens, reads c + t + 1); per layer and head,
  q·k and the weighted sum of v cost 2 · d_head FLOPs per key each;
- ``scored``: positions projected through the output head (``V_out`` = vocabulary size for an LM,
  1 for a value head); the embedding lookup, norms, activations and softmax are not counted.

Training counts 3 forwards (backward = 2: the gradients of the activations and of the weights). A LoRA
model's frozen base computes no weight gradients: its matmuls count 2 forwards, attention (no weights)
still 3, and the adapters' own matmuls 3 (`TransformerFlops.train`); the first block's input gradients,
which autograd skips because the embeddings are frozen, are counted anyway (≤ 1/L of the blocks'
backward: an upper bound). Work a pass does twice by choice is not counted (as in PaLM's MFU): the fused LM head's recompute in its
backward, activation checkpointing's second forward.

The peak is per device in the dtype of the pass: given (``trainer.peak_flops``) or measured by `matmul_peak`
(on CPU with this thread's intra-op threads: a rank's "device" is its threads), once per host and kept in the
calibration file (`utils.calibration`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from torchrlhf.models.moe import active_expert_params
from torchrlhf.models.parallelize import find_transformer_blocks
from torchrlhf.utils import calibration

TRAIN_FORWARDS = 3  # forward + backward (activation and weight gradients)


@dataclass(frozen=True)
class TransformerFlops:
    """What the count needs from a model: its blocks' matmul weights, attention shape and output head."""

    layers: int
    block_params: int  # Linear weights over all blocks
    heads: int
    head_dim: int
    hidden: int
    head_out: int  # vocabulary size (LM) or 1 (value head)
    adapter_params: int = 0  # LoRA factors over all blocks (their base weights are then frozen)

    @classmethod
    def from_model(cls, model: nn.Module) -> TransformerFlops:
        """From a built model (FSDP2/TP DTensors count their global size; a meta-device model works too)."""
        config = model.config
        blocks = find_transformer_blocks(model)
        linear = sum(m.weight.numel() for m in blocks.modules() if isinstance(m, nn.Linear))
        linear += active_expert_params(blocks)
        adapters = sum(p.numel() for n, p in blocks.named_parameters() if n.endswith((".lora_A", ".lora_B")))
        heads = config.num_attention_heads
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if head is None:
            head = getattr(model, "score", None)
        return cls(layers=len(blocks), block_params=linear, heads=heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   hidden=config.hidden_size, head_out=head.out_features if head is not None else 0,
                   adapter_params=adapters)

    def forward(self, tokens: int, keys: int, scored: int) -> int:
        """FLOPs of one forward over ``tokens`` tokens reading ``keys`` keys in all, ``scored`` of them projected."""
        return (2 * (self.block_params + self.adapter_params) * tokens
                + 4 * self.layers * self.heads * self.head_dim * keys + 2 * self.hidden * self.head_out * scored)

    def train(self, tokens: int, keys: int, scored: int) -> int:
        """FLOPs of forward + backward: 3 forwards; with adapters (a frozen base, LoRA) the base's matmuls and
        the head 2 (no weight gradients), attention and the adapters 3."""
        if not self.adapter_params:
            return TRAIN_FORWARDS * self.forward(tokens, keys, scored)
        frozen = 2 * self.block_params * tokens + 2 * self.hidden * self.head_out * scored
        trained = 4 * self.layers * self.heads * self.head_dim * keys + 2 * self.adapter_params * tokens
        return 2 * frozen + TRAIN_FORWARDS * trained


def causal_keys(length: int, context: int = 0) -> int:
    """Keys read by ``length`` causal tokens after ``context`` tokens they all see: sum of c + t, t = 1..length."""
    return length * context + length * (length + 1) // 2


def generation_counts(prompt_lens: list[int], response_lens: list[int]) -> tuple[int, int, int]:
    """(tokens, keys, scored) of generating ``response_lens`` tokens, ``len(response_lens) // len(prompt_lens)``
    samples per prompt (sample i answers prompt i // n): each prompt is prefilled once (its last position
    scored), then every sample feeds back all its tokens but the last, one decode step each."""
    n = len(response_lens) // max(len(prompt_lens), 1)
    tokens, keys, scored = sum(prompt_lens), sum(causal_keys(p) for p in prompt_lens), len(prompt_lens)
    for i, r in enumerate(response_lens):
        steps = max(r - 1, 0)
        tokens, scored = tokens + steps, scored + steps
        keys += causal_keys(steps, prompt_lens[i // n])
    return tokens, keys, scored


# ------------------------------------------------------------------ the peak
_given_peak: float | None = None
_measured: dict[tuple[str, torch.dtype, int], float] = {}


def set_peak_flops(value: float | None) -> None:
    """Use ``value`` FLOP/s per device for every dtype (``trainer.peak_flops``); None: measure."""
    if value is not None and not value > 0:
        raise ValueError(f"peak_flops must be > 0, got {value}")
    global _given_peak
    _given_peak = value


def peak_flops(dtype: torch.dtype, device: torch.device) -> float:
    """The given peak, else `matmul_peak` for ``dtype`` on ``device`` at this thread count, measured once per host
    (kept in the calibration file) and read once per process."""
    if _given_peak is not None:
        return _given_peak
    threads = torch.get_num_threads()
    key = (device.type, dtype, threads)
    if key not in _measured:
        name = f"matmul_peak/{calibration.device_name(device)}/{dtype}/threads={threads}/torch={torch.__version__}"
        _measured[key] = calibration.measured(name, lambda: matmul_peak(dtype, device))
    return _measured[key]


_LAYOUTS = {"x @ w.T": lambda a, b: a @ b.t(), "g @ w": lambda a, b: a @ b, "g.T @ x": lambda a, b: a.t() @ b}


def matmul_peak(dtype: torch.dtype, device: torch.device, size: int | None = None, min_seconds: float = 0.2) -> float:
    """Best FLOP/s of a square GEMM in ``dtype``, over the three layouts a training step runs (forward
    ``x @ w.T``, activation gradient ``g @ w``, weight gradient ``g.T @ x``), each for ``min_seconds``.

    Square and large, so the best rate the device's GEMMs reach: 4096 on a GPU; on a CPU the best of 1024
    and 2048 (``size``: that one only). A CPU's fp32 rate is flat from 1024 on, but AMX bf16 is not: on the
    Intel host 1024 read 1560-1910 GFLOP/s and 2048 2560-2870, the rate the model's own GEMMs reach
    (2470-2650 at 1888 x 576 x 1536). The best of several runs, so that another process's burst does not
    lower it. On a CPU without bf16 instructions bf16 GEMMs differ by 10x between layouts: the best is the peak,
    and a larger size reads only the layout that was best at the smaller one (a slow layout at 2048 costs
    minutes there).
    """
    device = torch.device(device)
    sizes = (size,) if size else ((1024, 2048) if device.type == "cpu" else (4096,))
    layouts, best = list(_LAYOUTS), 0.0
    for n in sizes:
        rates = {name: _square_gemm_rate(n, _LAYOUTS[name], dtype, device, min_seconds) for name in layouts}
        layouts = [max(rates, key=rates.__getitem__)]
        best = max(best, *rates.values())
    return best


def _square_gemm_rate(
    n: int, gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dtype: torch.dtype, device: torch.device,
    min_seconds: float,
) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, generator=g, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    gemm(a, b)  # warm-up: kernel selection, caches
    sync()
    best, spent, runs = float("inf"), 0.0, 0
    while spent < min_seconds or runs < 3:
        start = time.perf_counter()
        gemm(a, b)
        sync()
        took = time.perf_counter() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return 2.0 * n**3 / best


__all__ = ["TRAIN_FORWARDS", "TransformerFlops", "causal_keys", "generation_counts", "matmul_peak", "peak_flops",
           "set_peak_flops"]
