"""The RL post-training recipe: PPO, GRPO, RLOO, REINFORCE++, ReMax, Safe-RLHF, DAPO, Dr.GRPO, GSPO, CISPO.

    torchrun --nproc_per_node=2 recipes/ppo.py --config recipes/configs/grpo_arithmetic_cpu.yaml
    python recipes/ppo.py --config recipes/configs/grpo_arithmetic_cpu.yaml trainer.total_steps=2  # one process
    python recipes/ppo.py --config X.yaml --dry-run --world-size 8   # what it would do; loads no weights
    python recipes/ppo.py --config X.yaml --plan --world-size 8      # the fastest mapping, written as a config

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
from torchrlhf.plan.cli import calibrate_here, hardware_profile, plan_command, simulated_lines
from torchrlhf.trainer.explain import explain
from torchrlhf.trainer.run import load, run


FLAGS = {"--dry-run": bool, "--plan": bool, "--calibrate": bool, "--world-size": int, "--nodes": int,
         "--hardware": str, "--hardware-out": str, "--plan-out": str, "--threads": int, "--response-len": int}


def _take_flags(argv: list[str]) -> tuple[list[str], dict]:
    """Remove the ``--flag [value]`` options of `FLAGS` from the command line (the rest is config and overrides)."""
    rest, flags = [], {}
    it = iter(argv)
    for arg in it:
        name = arg.split("=", 1)[0]
        if name not in FLAGS:
            rest.append(arg)
            continue
        kind = FLAGS[name]
        if kind is bool:
            flags[name] = True
            continue
        value = arg.split("=", 1)[1] if "=" in arg else next(it, "")
        if kind is int and (not value.isdigit() or int(value) < 1):
            raise ConfigError(f"{name} needs a positive integer, got {value!r}")
        if not value:
            raise ConfigError(f"{name} needs a value")
        flags[name] = kind(value)
    return rest, flags


USAGE = """usage: recipes/ppo.py --config X.yaml [--dry-run | --plan] [--world-size N] [key=value | +key=value | ~key ...]
       recipes/ppo.py --calibrate [--config X.yaml] [--hardware-out FILE] [--threads N]

  --config X.yaml     the recipe config (recipes/configs/*.yaml)
  --dry-run           print what the config would do (roles, ranks, batches, memory; with --hardware, the
                      simulated time of each stage) without loading weights
  --plan              rank the placements, layouts, micro-batches and schedules of this config on --world-size
                      ranks (--nodes M nodes) by simulated step time; print the best and write it as a config
  --world-size N      the dry run's or the plan's number of ranks (default: torchrun's WORLD_SIZE, else 1)
  --nodes M           nodes the plan's ranks are spread over (default 1)
  --hardware H        a hardware profile: a shipped name (h100, cpu_xeon_2core) or a file (default: the profile
                      --calibrate wrote for this machine)
  --plan-out FILE     where --plan writes its config (default: <trainer.output_dir>/plan_w<N>.yaml)
  --response-len L    the mean response length --plan assumes (default: rollout.max_tokens)
  --calibrate         measure this machine's hardware profile (6-7 min on 2 cores) and write it (--hardware-out FILE,
                      default ~/.cache/torchrlhf/hardware.yaml); with --config, on its actor's architecture
  --threads N         threads per rank for --calibrate (default 1, as torchrun's ranks)
  key=value           override a config key (+key=value adds one, ~key removes one)"""


def cli(argv: list[str] | None = None) -> None:
    rank = int(os.environ.get("RANK", "0"))
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        print(USAGE)
        return
    try:
        argv, flags = _take_flags(args)
        world_size = flags.get("--world-size") or int(os.environ.get("WORLD_SIZE", "1"))
        if flags.get("--calibrate"):
            config = parse_args(argv)[0] if argv else None
            print(f"torchrlhf: hardware profile written to {calibrate_here(config, flags)}")
            return
        path, overrides = parse_args(argv)
        # User modules in the project folder import by name (my_env.Env), as under `python -m`: Python put
        # this script's folder first on the path, not the folder the run started in.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        cfg, raw = load(path, overrides, world_size)  # the schema checks every key
        hardware = (hardware_profile(flags.get("--hardware"), required=bool(flags.get("--plan")))
                    if flags.get("--dry-run") or flags.get("--plan") else None)
    except (ConfigError, FileNotFoundError) as e:  # every rank finds it: printed once, whichever rank exits first
        exit_every_rank(f"torchrlhf: config error: {e}", 2)
    if flags.get("--dry-run") or flags.get("--plan"):
        if rank == 0:
            try:
                if flags.get("--plan"):
                    print(plan_command(cfg, path, overrides, world_size, flags.get("--nodes", 1), hardware,
                                       flags.get("--plan-out"), flags.get("--response-len")))
                else:
                    print(explain(cfg, world_size))
                    if hardware is not None:
                        print(simulated_lines(cfg, world_size, hardware))
            except (ConfigError, OSError, ValueError) as e:  # a model path without a config.json, ...
                print(f"torchrlhf: config error: {e}", file=sys.stderr)
                sys.exit(2)
        return
    launch(run, cfg, raw, world_size)  # rank 0: build the worker groups and the trainer, fit


if __name__ == "__main__":
    cli()
