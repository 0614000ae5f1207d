"""The RL post-training recipe: PPO, GRPO, RLOO, REINFORCE++, ReMax, Safe-RLHF, DAPO, Dr.GRPO, GSPO, CISPO.

    torchrun --nproc_per_node=2 recipes/ppo.py --config recipes/configs/grpo_arithmetic_cpu.yaml
    python recipes/ppo.py --config recipes/configs/grpo_arithmetic_cpu.yaml trainer.total_steps=2  # one process
    python recipes/ppo.py --config X.yaml --dry-run --world-size 8   # what it would do; loads no weights

Every rank parses and validates the config (a bad key fails before any model loads), then `launch`
makes rank 0 the single controller: it builds the worker groups and runs `RLTrainer.fit`, the
dataflow of one step being: generate -> reward -> old/ref log-probs (+ values) -> advantages ->
critic update -> actor update. The algorithm is chosen by the config, not by the recipe.
"""

from __future__ import annotations

import os
import sys

from torchrlhf.config import ConfigError, parse_args
from torchrlhf.runtime import exit_every_rank, launch
from torchrlhf.trainer.explain import explain
from torchrlhf.trainer.run import load, run


def _take_flags(argv: list[str]) -> tuple[list[str], bool, int | None]:
    """Remove ``--dry-run`` and ``--world-size N`` from the command line (the rest is config and overrides)."""
    rest, dry_run, world = [], False, None
    it = iter(argv)
    for arg in it:
        if arg == "--dry-run":
            dry_run = True
        elif arg == "--world-size" or arg.startswith("--world-size="):
            value = arg.split("=", 1)[1] if "=" in arg else next(it, "")
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--world-size needs a positive integer, got {value!r}")
            world = int(value)
        else:
            rest.append(arg)
    return rest, dry_run, world


USAGE = """usage: recipes/ppo.py --config X.yaml [--dry-run [--world-size N]] [key=value | +key=value | ~key ...]

  --config X.yaml   the recipe config (recipes/configs/*.yaml)
  --dry-run         print what the config would do (roles, ranks, batches, memory) without loading weights
  --world-size N    the dry run's number of ranks (default: torchrun's WORLD_SIZE, else 1)
  key=value         override a config key (+key=value adds one, ~key removes one)"""


def cli(argv: list[str] | None = None) -> None:
    rank = int(os.environ.get("RANK", "0"))
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(USAGE)
        return
    try:
        argv, dry_run, world = _take_flags(args)
        world_size = world or int(os.environ.get("WORLD_SIZE", "1"))
        path, overrides = parse_args(argv)
        # User modules in the project folder import by name (my_env.Env), as under `python -m`: Python put
        # this script's folder first on the path, not the folder the run started in.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        cfg, raw = load(path, overrides, world_size)  # the schema checks every key
    except (ConfigError, FileNotFoundError) as e:  # every rank finds it: printed once, whichever rank exits first
        exit_every_rank(f"torchrlhf: config error: {e}", 2)
    if dry_run:
        if rank == 0:
            try:
                print(explain(cfg, world_size))
            except (OSError, ValueError) as e:  # a model path without a config.json, ...
                print(f"torchrlhf: config error: {e}", file=sys.stderr)
                sys.exit(2)
        return
    launch(run, cfg, raw, world_size)  # rank 0: build the worker groups and the trainer, fit


if __name__ == "__main__":
    cli()
