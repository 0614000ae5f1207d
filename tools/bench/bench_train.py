"""Tokens/s of `ActorWorker.update` on SmolLM2-135M vs a plain HF forward/backward/AdamW loop, same data, same run.

Both sides train on identical synthetic rollouts (left-padded prompts, right-padded
responses of varied length) with the same micro-batch size and a token-mean PPO
loss, one optimizer step per mini-batch. Throughput counts valid (attended) tokens.

    python tools/bench/bench_train.py [--samples 16 --prompt-len 64 --response-len 64 --micro 4 --steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from torchrlhf.data import Batch
from torchrlhf.models import load_causal_lm, smollm2_model_dir
from torchrlhf.workers.actor import ActorWorker


def synthetic_rollouts(n: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt_len // 2, prompt_len + 1, (n,), generator=g)
    r_lens = torch.randint(response_len // 4, response_len + 1, (n,), generator=g)
    p_mask = (torch.arange(prompt_len) >= prompt_len - p_lens[:, None]).long()
    r_mask = (torch.arange(response_len) < r_lens[:, None]).long()
    prompts = torch.randint(10, vocab, (n, prompt_len), generator=g) * p_mask
    responses = torch.randint(10, vocab, (n, response_len), generator=g) * r_mask
    mask = torch.cat([p_mask, r_mask], 1)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "response_mask": r_mask,
            "old_log_probs": torch.full((n, response_len), -5.0) * r_mask,
            "advantages": torch.randn(n, response_len, generator=g) * r_mask,
        },
        meta={"temperature": 1.0},
    )


def worker_step(path: str, batch: Batch, micro: int) -> Callable[[], None]:
    actor = ActorWorker(path, lr=1e-6, ppo_mini_batch_size=len(batch), rollout_n=1,
                        ppo_micro_batch_size_per_device=micro)
    return lambda: actor.update(batch)


def plain_hf_step(path: str, batch: Batch, micro: int) -> Callable[[], None]:
    """The textbook loop: full padded micro-batches, logits for every position, PPO token-mean loss."""
    model = load_causal_lm(path, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    r = batch["responses"].shape[1]
    total_tokens = batch["response_mask"].sum()

    def step() -> None:
        for mb in batch.split(micro):
            logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                           position_ids=mb["position_ids"], use_cache=False).logits[:, -r - 1 : -1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, mb["responses"][..., None]).squeeze(-1)
            ratio = torch.exp(lp - mb["old_log_probs"])
            loss = -(mb["advantages"] * ratio.clamp(0.8, 1.2) * mb["response_mask"]).sum() / total_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[], None]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = str(smollm2_model_dir())
    vocab = 49152
    batch = synthetic_rollouts(args.samples, args.prompt_len, args.response_len, vocab)
    per_step_tokens = int(batch["attention_mask"].sum())
    print(f"SmolLM2-135M, {args.samples} samples x ({args.prompt_len}+{args.response_len}) cols, "
          f"{per_step_tokens} valid tokens/step ({batch['input_ids'].numel()} padded), micro={args.micro}, "
          f"steps={args.steps}, threads={args.threads}, device=cpu")
    sides = {
        "ActorWorker.update": worker_step(path, batch, args.micro),
        "plain HF loop": plain_hf_step(path, batch, args.micro),
    }
    for step in sides.values():
        step()  # warm-up
    # Alternate the two sides step by step so load from other processes hits both alike; report medians.
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.steps):
        for name, step in sides.items():
            times[name].append(timed(step))
    # Median and best step: on a shared CPU the best step is the least disturbed estimate.
    med = {name: per_step_tokens / statistics.median(t) for name, t in times.items()}
    best = {name: per_step_tokens / min(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"{name:<19}: median {med[name]:8.1f} / best {best[name]:8.1f} valid tokens/s "
              f"(step s: {', '.join(f'{x:.2f}' for x in t)})")
    worker, plain = "ActorWorker.update", "plain HF loop"
    print(f"ratio worker/plain : median {med[worker] / med[plain]:.2f}x / best {best[worker] / best[plain]:.2f}x")


if __name__ == "__main__":
    main()
