"""Sampled-token log-prob gap between each rollout engine and a training forward, per engine and dtype.

SmolLM2-135M-Instruct: each engine samples (temperature 1) in its dtype; the actor's own training forward
(`ActorWorker.compute_log_prob`, fp32, shared-prefix with the fused head) scores the same tokens on the same
weights.
Prints the max and mean absolute gap over response tokens: what `training/rollout_probs_diff_*` shows in
a run, before any update.

    python tools/bench/bench_logprob_gap.py [--prompts 16 --n 4 --max-tokens 48 --threads 2]
"""

from __future__ import annotations

import argparse

import torch

from torchrlhf.data.batch import Batch
from torchrlhf.generation import NativeEngine, SamplingParams, VLLMEngine, vllm_available
from torchrlhf.models import load_tokenizer, smollm2_model_dir
from torchrlhf.workers import ActorWorker

PROMPTS = ["What is 17 times 23?", "Write a haiku about rain.", "Name three prime numbers.",
           "Explain gravity in one sentence."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = str(smollm2_model_dir())
    tok = load_tokenizer(path)
    tok.padding_side = "left"
    enc = tok([PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)], return_tensors="pt", padding=True)
    prompts = Batch({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    actor = ActorWorker(path, freeze=True)  # one process: the plain fp32 module, the recipe's training forward
    engines = {"native": NativeEngine, **({"vllm": VLLMEngine} if vllm_available()[0] else {})}
    print(f"SmolLM2-135M, {args.prompts} prompts x {args.n} samples x <= {args.max_tokens} tokens, T=1; "
          "reference: the actor's training forward in float32")
    print(f"{'engine':<8} {'dtype':<9} {'max gap':>9} {'mean gap':>9} {'tokens':>7}")
    for name, cls in engines.items():
        for dtype in (torch.float32, torch.bfloat16):
            engine = cls(path, tok, max_batch_size=args.prompts * args.n, max_seq_len=128, dtype=dtype)
            out = engine.generate(prompts, sampling)
            if hasattr(engine, "shutdown"):
                engine.shutdown()
            with torch.no_grad():
                ref = actor.compute_log_prob(Batch(out.tensors), temperature=1.0)["old_log_probs"]
            mask = out["response_mask"].bool()
            gap = (out["rollout_log_probs"] - ref).abs()[mask]
            print(f"{name:<8} {str(dtype).split('.')[-1]:<9} {gap.max():>9.2e} {gap.mean():>9.2e} {int(mask.sum()):>7}",
                  flush=True)


if __name__ == "__main__":
    main()
