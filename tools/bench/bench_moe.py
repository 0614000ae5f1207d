"""The MoE actor update against a dense model with the same active weights, on CPU (one process, float32).

Both models share the attention (Qwen3: q/k norms, GQA), the depth and the vocabulary; per layer the MoE has
``--experts`` experts of width ``--width``, ``--top-k`` of them per token, and the dense model one SwiGLU MLP of
width ``top_k * width``: the same multiply-adds per token (the MoE adds its router). The MoE holds
``experts / top_k`` times the MLP weights. Both run the same GRPO-shaped batch (``bench_train.group_rollouts``)
through `ActorWorker.update`, alternated step by step, so a noisy host slows both alike. Prints each side's
median update seconds and response tokens per second, the MoE's ratio to dense, and its expert load
(``moe/expert_load/max_over_mean``: top-k choices of the busiest expert over the mean).

    python tools/bench/bench_moe.py [--layers 4 --hidden 256 --experts 16 --top-k 2 --width 128 --steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_train import group_rollouts  # noqa: E402

from torchrlhf.workers import ActorWorker, Batching  # noqa: E402

VOCAB = 8192


def save_models(root: str, args: argparse.Namespace) -> dict[str, str]:
    common = dict(vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=args.hidden // 4, max_position_embeddings=1024,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    models = {
        "dense": transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            intermediate_size=args.top_k * args.width, **common)),
        "moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=args.top_k * args.width, moe_intermediate_size=args.width, num_experts=args.experts,
            num_experts_per_tok=args.top_k, norm_topk_prob=True, **common)),
    }
    paths = {}
    for name, model in models.items():
        paths[name] = os.path.join(root, name)
        model.save_pretrained(paths[name])
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batch = group_rollouts(args.prompts, args.n, args.prompt_len, args.response_len, VOCAB)
    tokens = int(batch["response_mask"].sum())
    with tempfile.TemporaryDirectory() as root:
        paths = save_models(root, args)
        actors = {name: ActorWorker(path, run={"rollout_n": args.n}, batching=Batching(
            ppo_mini_batch_size=args.prompts, ppo_micro_batch_size_per_device=args.prompts * args.n))
            for name, path in paths.items()}
        params = {name: sum(p.numel() for p in a.model.parameters()) for name, a in actors.items()}
        seconds: dict[str, list[float]] = {name: [] for name in actors}
        load = []
        for step in range(args.steps + 1):  # the first step of each side warms up and is not counted
            for name, actor in actors.items():
                start = time.perf_counter()
                metrics = actor.update(batch, temperature=1.0)
                if step:
                    seconds[name].append(time.perf_counter() - start)
                if name == "moe":
                    load.append(metrics["moe/expert_load/max_over_mean"])
    print(f"MoE: {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.width}, "
          f"top-{args.top_k}; dense: one MLP of width {args.top_k * args.width}; {args.prompts} x {args.n} samples "
          f"of {args.prompt_len} + <= {args.response_len} tokens ({tokens} response tokens), {args.threads} thread(s)")
    print(f"{'model':<6} {'params (M)':>10} {'update s (median)':>18} {'response tok/s':>15}")
    med = {name: statistics.median(s) for name, s in seconds.items()}
    for name in actors:
        print(f"{name:<6} {params[name] / 1e6:>10.2f} {med[name]:>18.3f} {tokens / med[name]:>15.1f}")
    print(f"expert load, max over mean (per update): {', '.join(f'{x:.2f}' for x in load)}")
    print(f"moe/dense update throughput {med['dense'] / med['moe']:.2f}x")


if __name__ == "__main__":
    main()
