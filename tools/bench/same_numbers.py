"""Does a refactor change any number? Run five recipe settings on this tree and on a git ref, compare.

Each setting trains a tiny random Llama (SmolLM2's tokenizer) for a few steps under torchrun on CPU, once
from this checkout and once from ``--ref`` (checked out into a temporary git worktree), and compares every
logged metric (timings and throughput excluded: they are the machine's, not the run's) and every tensor of
the final actor checkpoint for exact equality.

    python tools/bench/same_numbers.py --ref 06f545f
    python tools/bench/same_numbers.py --ref HEAD~3 --settings sync_grpo ppo_critic

Settings: sync GRPO on 2 ranks, sync split placement on 3 ranks, PPO with a critic, KL in the reward with
2 mini-batches x 2 epochs, the deterministic asynchronous schedule on 3 ranks.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from torchrlhf.models import save_tiny_model  # noqa: E402
from torchrlhf.utils.logging import read_metrics  # noqa: E402

STEPS = 3
SPLIT = {"actor": [0], "rollout": [1, 2]}
# name -> (ranks, config sections over BASE)
SETTINGS: dict[str, tuple[int, dict[str, Any]]] = {
    "sync_grpo": (2, {}),
    "split": (3, {"placement": SPLIT}),
    "ppo_critic": (2, {"algorithm": {"adv_estimator": "gae"},
                       "critic": {"model_path": "${model_path}",  # batching given: refs before c5b9575 need it
                                  "batching": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 2}}}),
    "kl_in_reward_2x2": (2, {"algorithm": {"use_kl_in_reward": True},
                             "actor": {"batching": {"ppo_mini_batch_size": 2, "ppo_epochs": 2,
                                                    "ppo_micro_batch_size_per_device": 1}}}),
    "async_deterministic": (3, {"placement": SPLIT, "trainer": {"mode": "async"},
                                "async_training": {"schedule": "deterministic", "max_staleness": 1}}),
}
IGNORED = ("timing_s/", "perf/", "rollout/busy_fraction", "weight_sync/send_s", "step_time", "throughput")


def base_config(model_dir: str, data_dir: Path) -> dict[str, Any]:
    return {
        "model_path": model_dir,
        "actor": {"model_path": "${model_path}", "optim": {"lr": 3e-3},
                  "batching": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 2}},
        "data": {"train_files": [str(data_dir / "arithmetic_train.jsonl")],
                 "val_files": [str(data_dir / "arithmetic_test.jsonl")],
                 "max_prompt_length": 64, "train_batch_size": 4, "val_batch_size": 16, "val_max_samples": 16},
        "rollout": {"n": 4, "max_tokens": 8, "engine": {"max_batch_size": 16, "max_seq_len": 80}},
        "algorithm": {"adv_estimator": "grpo"},
        "reward": {"isolate": False},
        "trainer": {"total_steps": STEPS, "checkpoint": {"save_freq": STEPS, "resume": "disable"},
                    "loggers": ["jsonl"], "test_freq": 0, "val_before_train": False},
    }


def merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def with_old_keys(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` in the keys a ref from before a regrouping reads: every key this tree's ``MOVED_KEYS`` moved
    goes back to where it was, and a section left empty goes."""
    from torchrlhf.trainer.schema import MOVED_KEYS

    config, values = OmegaConf.create(config), {}
    for old, new in MOVED_KEYS.items():
        parent, _, leaf = new.rpartition(".")
        node = OmegaConf.select(config, parent) if parent else config
        if node is not None and leaf in node:
            values[old] = node.pop(leaf)
            if not node and parent:  # a section now empty: the ref does not know it
                grand, _, name = parent.rpartition(".")
                (OmegaConf.select(config, grand) if grand else config).pop(name)
    for old, value in values.items():
        OmegaConf.update(config, old, value, force_add=True)
    return OmegaConf.to_container(config)


def run(tree: Path, config: dict[str, Any], ranks: int, out: Path) -> tuple[list[dict[str, Any]], dict]:
    """Train with the recipe of ``tree``; returns (metrics per step, the final actor weights). A ref that
    refuses this tree's config gets the keys where it kept them (`with_old_keys`)."""
    config = merged(config, {"trainer": {"output_dir": str(out)}})
    path = out.with_suffix(".yaml")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(tree / "recipes" / "ppo.py"), "--config", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(tree)}
    for attempt in (config, with_old_keys(config)):
        OmegaConf.save(OmegaConf.create(attempt), path)
        p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        if "torchrlhf: config error:" not in p.stdout + p.stderr:
            break
    if p.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(cmd)} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    flat = out / "flat.pt"
    dcp_to_torch_save(out / f"global_step_{STEPS}" / "actor", flat)
    return read_metrics(str(out / "metrics.jsonl")), torch.load(flat, weights_only=True)["model"]


def differences(a: tuple[list, dict], b: tuple[list, dict]) -> list[str]:
    (ma, wa), (mb, wb) = a, b
    diffs = []
    for step, (ra, rb) in enumerate(zip(ma, mb), 1):
        keys = {k for k in ra.keys() | rb.keys() if not k.startswith(IGNORED)}
        diffs += [f"step {step} {k}: {ra.get(k)} vs {rb.get(k)}" for k in sorted(keys) if ra.get(k) != rb.get(k)]
    if len(ma) != len(mb):
        diffs.append(f"{len(ma)} vs {len(mb)} steps logged")
    diffs += [f"weight {k} differs" for k in sorted(wa.keys() | wb.keys())
              if k not in wa or k not in wb or not torch.equal(wa[k], wb[k])]
    return diffs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the git ref to compare this tree against")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="same_numbers_") as tmp:
        tmp = Path(tmp)
        old = tmp / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.ref], cwd=REPO, check=True,
                       capture_output=True)
        try:
            model = str(save_tiny_model(tmp / "tiny", tokenizer_from="smollm2", initializer_range=1.0))
            base = base_config(model, REPO / "recipes" / "data")
            failed = 0
            for name in args.settings:
                ranks, sections = SETTINGS[name]
                config = merged(base, sections)
                runs = [run(tree, config, ranks, tmp / f"{name}_{which}") for which, tree in (("new", REPO), ("ref", old))]
                diffs = differences(*runs)
                failed += bool(diffs)
                n_metrics = len({k for k in runs[0][0][-1] if not k.startswith(IGNORED)})
                verdict = "identical" if not diffs else f"DIFFERENT ({len(diffs)}): " + "; ".join(diffs[:5])
                print(f"{name:<22} {ranks} ranks: {n_metrics} metrics x {STEPS} steps, "
                      f"{len(runs[0][1])} weights: {verdict}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO, capture_output=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
