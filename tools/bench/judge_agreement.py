"""How often a recipe's LLM judge agrees with the rule reward on held-out samples.

The policy (the config's actor model) answers ``--samples`` held-out prompts once each, sampled at the
config's ``rollout.temperature``; the rule reward (the data source's built-in, e.g. ``arithmetic``) and the
config's ``judge`` section (a `JudgeWorker`, in this process) score every answer. Agreement is the share of
samples where the judge's verdict (score >= ``--threshold``; a failed verdict counts at ``on_failure_score``,
as in training) equals the rule's (score >= 0.5). Cohen's kappa corrects it for chance.

    python tools/bench/judge_agreement.py --config recipes/configs/grpo_arithmetic_judge_cpu.yaml --threads 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from torchrlhf.config import load_config
from torchrlhf.data import Batch
from torchrlhf.data.dataset import PromptDataset
from torchrlhf.generation import NativeEngine, SamplingParams
from torchrlhf.models import load_tokenizer
from torchrlhf.rewards import get_reward_fn
from torchrlhf.trainer.schema import load_recipe_config, resolve_model_path, section_kwargs
from torchrlhf.workers.judge import JudgeWorker


def cohen_kappa(a: list[bool], b: list[bool]) -> float:
    """Agreement of two binary raters beyond what their marginal rates give by chance."""
    n = len(a)
    observed = sum(x == y for x, y in zip(a, b)) / n
    pa, pb = sum(a) / n, sum(b) / n
    chance = pa * pb + (1 - pa) * (1 - pb)
    return float("nan") if chance == 1 else (observed - chance) / (1 - chance)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a recipe config with a judge section")
    ap.add_argument("--data", default=None, help="held-out prompts (default: the config's first data.val_files)")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--threshold", type=float, default=0.5, help="a judge score at or above it is 'correct'")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the numbers and every sample here (JSON)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_recipe_config(load_config(args.config), 1)
    if cfg.judge is None:
        raise SystemExit(f"{args.config}: has no judge section")
    policy_path = resolve_model_path(cfg.actor.model_path)
    tokenizer = load_tokenizer(resolve_model_path(cfg.tokenizer_path or cfg.actor.model_path))
    data = cfg.data
    dataset = PromptDataset(args.data or data.val_files[0], tokenizer, prompt_key=data.prompt_key,
                            max_prompt_length=data.max_prompt_length, apply_chat_template=data.apply_chat_template,
                            system_prompt=data.system_prompt, max_samples=args.samples)
    prompts = dataset.collate(range(len(dataset)))

    start = time.perf_counter()
    engine = NativeEngine(policy_path, tokenizer, max_batch_size=64,
                          max_seq_len=data.max_prompt_length + cfg.rollout.max_tokens, dtype=torch.float32)
    gen = engine.generate(prompts, SamplingParams(temperature=cfg.rollout.temperature, max_tokens=cfg.rollout.max_tokens,
                                                  seed=args.seed, logprobs=False))
    del engine
    generate_s = time.perf_counter() - start
    mask = gen["response_mask"].bool()
    texts = tokenizer.batch_decode([gen["responses"][i][mask[i]].tolist() for i in range(len(gen))],
                                   skip_special_tokens=True)
    rule = [get_reward_fn(src)(t, gt) >= 0.5 for t, gt, src in zip(texts, gen["ground_truth"], gen["data_source"])]

    start = time.perf_counter()
    kwargs = {**section_kwargs(cfg, "judge"), "model_path": resolve_model_path(cfg.judge.model_path)}
    judge = JudgeWorker(**kwargs)
    out = judge.judge(Batch(dict(gen.tensors), {k: v for k, v in gen.non_tensors.items()}))
    judge.parser.close()
    judge_s = time.perf_counter() - start
    scores = out["judge_scores"].tolist()
    verdict = [s >= args.threshold for s in scores]
    failed = (out["judge_parse_failed"] | out["judge_timed_out"] | out["judge_too_long"]).tolist()
    n = len(rule)
    parsed = [i for i in range(n) if not failed[i]]
    result = {
        "config": args.config, "samples": n, "seed": args.seed,
        "rule_accuracy": sum(rule) / n,
        "judge_says_correct": sum(verdict) / n,
        "judge_failures": sum(failed),
        "agreement": sum(v == r for v, r in zip(verdict, rule)) / n,
        "agreement_on_parsed": (sum(verdict[i] == rule[i] for i in parsed) / len(parsed)) if parsed else float("nan"),
        "cohen_kappa": cohen_kappa(verdict, rule),
        "confusion": {"judge1_rule1": sum(v and r for v, r in zip(verdict, rule)),
                      "judge1_rule0": sum(v and not r for v, r in zip(verdict, rule)),
                      "judge0_rule1": sum(r and not v for v, r in zip(verdict, rule)),
                      "judge0_rule0": sum(not v and not r for v, r in zip(verdict, rule))},
        "generate_s": round(generate_s, 1), "judge_s": round(judge_s, 1),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        samples = [{"prompt": gen["raw_prompt"][i], "response": texts[i], "ground_truth": gen["ground_truth"][i],
                    "rule": rule[i], "judge_score": scores[i], "judge_failed": failed[i]} for i in range(n)]
        with open(args.out, "w") as f:
            json.dump({**result, "per_sample": samples}, f, indent=1)


if __name__ == "__main__":
    main()
