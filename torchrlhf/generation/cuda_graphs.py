"""CUDA-graph replay of the decode step.

A decode step of a small model is hundreds of small kernels (30 layers x ~45 ops for
SmolLM2-135M); on a GPU their launch cost, not their math, sets the step time.
Capturing the step once and replaying it turns those launches into one.

A graph fixes its shapes, so steps are bucketed: the span of slots to a power of
two (capped at the pool size) and the attended KV length to a multiple of
``kv_block``. Padding is harmless by construction: rows past the span are free
slots fed the scratch position ``max_seq_len - 1``, which no sample and no cached
prefix holds, and KV positions past a row's own position are masked out of attention.

Graphs hold the addresses of the KV cache and the weights, so they are only valid
until those are freed (`NativeEngine.release`); the engine drops them then. `capture_all`
captures every bucket at once, so that no later step pays for a capture (a warm-up spike).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _span_bucket(span: int, max_span: int) -> int:
    return min(1 << (span - 1).bit_length(), max_span)


class GraphedDecode:
    """A decode step (``CachedDecoder.decode``, or its ``torch.compile``-d form) with the same signature,
    replayed from captured CUDA graphs.

    Graphs are captured by `capture_all`, or else the first time a (span bucket, KV bucket) pair is
    needed, and share one memory pool (their intermediates are dead after each replay;
    only the static inputs and logits stay reserved). The logits returned are a view
    of a static buffer, valid until the next call.
    """

    def __init__(self, step: Callable[..., torch.Tensor], k_cache: torch.Tensor, v_cache: torch.Tensor,
                 kv_block: int = 256):
        if k_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the KV cache on a CUDA device, got {k_cache.device}")
        self.step = step
        self.k_cache, self.v_cache = k_cache, v_cache
        self.max_span, self.max_seq_len = k_cache.shape[1], k_cache.shape[2]
        self.kv_block = kv_block
        device = k_cache.device
        self.tokens = torch.zeros(self.max_span, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_span, dtype=torch.long, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _capture(self, span: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        args = (self.tokens[:span], self.positions[:span], span, kv_len, self.k_cache, self.v_cache)
        # One eager run on a side stream first: lazy initialisation (cuBLAS handles,
        # kernel selection) must not happen inside the capture. It computes the same
        # step the replay will, so the KV it writes is rewritten with equal values.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.step(*args)
        return graph, logits

    def buckets(self) -> list[tuple[int, int]]:
        """Every (span bucket, KV bucket) pair a step can need."""
        spans = sorted({_span_bucket(s, self.max_span) for s in range(1, self.max_span + 1)})
        kvs = sorted({min(b, self.max_seq_len) for b in range(self.kv_block, self.max_seq_len + self.kv_block,
                                                             self.kv_block)})
        return [(s, kv) for s in spans for kv in kvs]

    def capture_all(self) -> None:
        """Capture every bucket now (steps then only replay). Inputs are token 0 at the scratch position
        (junk written where nothing is kept)."""
        self.tokens.zero_()
        self.positions.fill_(self.max_seq_len - 1)
        for key in self.buckets():
            if key not in self.graphs:
                self.graphs[key] = self._capture(*key)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, span: int, kv_len: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        if k_cache is not self.k_cache or v_cache is not self.v_cache:
            raise RuntimeError("GraphedDecode was captured on another KV cache; build a new one after resume()")
        bucket = _span_bucket(span, self.max_span)
        kv_bucket = min(-(-kv_len // self.kv_block) * self.kv_block, self.max_seq_len)
        self.tokens[:span].copy_(tokens)
        self.positions[:span].copy_(positions)
        if bucket > span:
            self.tokens[span:bucket].zero_()
            self.positions[span:bucket].fill_(self.max_seq_len - 1)
        key = (bucket, kv_bucket)
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, kv_bucket)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits[:span]
