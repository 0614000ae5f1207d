"""Can GRPO learn this task with this model? Sample a group per prompt and count the groups that carry a signal.

GRPO learns only from groups whose rewards differ: a group where every sample scores 0 (or every
one scores 1) has zero advantage and contributes no gradient. Before spending a training run, this
samples ``n`` responses for ``--prompts`` training prompts with the config's engine, sampling and
reward, and prints: greedy accuracy, per-sample accuracy, pass@n, the fraction of groups with a
signal, how often a response holds no number at all, how often it ended by itself (EOS / stop)
rather than at ``max_tokens``, and a few graded responses.

    python tools/bench/probe_task.py --config recipes/configs/grpo_arithmetic_learn.yaml
    python tools/bench/probe_task.py --config recipes/configs/grpo_gsm8k_smollm2.yaml --prompts 32 \\
        -- reward.reward_kwargs.method=flexible
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from torchrlhf.config import get_component, load_config  # noqa: E402
from torchrlhf.generation import SamplingParams  # noqa: E402
from torchrlhf.models import load_tokenizer  # noqa: E402
from torchrlhf.trainer.build import build_prompts  # noqa: E402
from torchrlhf.trainer.schema import resolve_model_path  # noqa: E402
from torchrlhf.trainer.schema import load_recipe_config, section_kwargs  # noqa: E402


def group_stats(scores: torch.Tensor) -> dict[str, float]:
    """``scores`` [prompts, n] -> per-sample accuracy, pass@n and the fraction of groups with differing rewards."""
    return {
        "sample_acc": scores.mean().item(),
        "pass_at_n": (scores.max(dim=1).values > 0).float().mean().item(),
        "groups_with_signal": (scores.max(dim=1).values != scores.min(dim=1).values).float().mean().item(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--prompts", type=int, default=64, help="training prompts to probe")
    parser.add_argument("--show", type=int, default=6, help="responses to print")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_recipe_config(load_config(args.config, args.overrides, add_missing=True), world_size=1)
    model_path = resolve_model_path(cfg.actor.model_path)
    tokenizer = load_tokenizer(resolve_model_path(cfg.tokenizer_path or cfg.actor.model_path))
    train, _ = build_prompts(cfg, tokenizer)
    prompts = train.dataset.collate(list(range(min(args.prompts, len(train.dataset)))))
    engine_cfg = {f.name: getattr(cfg.rollout.engine, f.name) for f in dataclasses.fields(cfg.rollout.engine)}
    engine = get_component(engine_cfg.pop("_component_"))(
        model_path, tokenizer, dtype=getattr(torch, cfg.actor.dtype), **engine_cfg)
    reward = get_component(cfg.reward._component_)(**section_kwargs(cfg, "reward", tokenizer=tokenizer))

    def graded(sampling: SamplingParams) -> tuple[torch.Tensor, list[str], list[str]]:
        gen = engine.generate(prompts, dataclasses.replace(sampling, seed=0))
        scores, _ = reward(gen)
        texts = train.decode(gen["responses"], gen["response_mask"])
        return scores.sum(-1), texts, list(gen["finish_reason"])

    greedy, _, _ = graded(cfg.rollout.val_sampling())
    scores, texts, finish = graded(cfg.rollout.sampling())
    n = cfg.rollout.n
    stats = {"greedy_acc": greedy.mean().item(), **group_stats(scores.view(-1, n)),
             "no_number": sum(re.search(r"\d", t) is None for t in texts) / len(texts),
             "ended_by_itself": sum(f != "length" for f in finish) / len(finish)}
    print(f"{args.config}: {len(prompts)} prompts x n={n}, T={cfg.rollout.temperature}, "
          f"max_tokens={cfg.rollout.max_tokens}")
    for key, value in stats.items():
        print(f"  {key:<20} {value:.3f}")
    for text, gt, score in list(zip(texts, [g for g in prompts["ground_truth"] for _ in range(n)], scores.tolist()))[
            : args.show * n : n]:
        print(f"  [{score:.0f}] truth {gt!r}: {text[:300]!r}")


if __name__ == "__main__":
    main()
