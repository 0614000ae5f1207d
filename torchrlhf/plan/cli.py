"""What ``recipes/ppo.py``'s ``--plan``, ``--calibrate`` and ``--dry-run --hardware`` do, so the recipe stays a recipe."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from torchrlhf.config import ConfigError
from torchrlhf.models.loading import USER_CACHE
from torchrlhf.plan.auto import format_plan, plan, write_plan
from torchrlhf.plan.calibrate import calibrate
from torchrlhf.plan.hardware import HardwareProfile, load_hardware, save_hardware
from torchrlhf.plan.problem import config_mapping, plan_input
from torchrlhf.plan.simulate import step_estimate
from torchrlhf.trainer.schema import RecipeConfig, resolve_model_path

DEFAULT_PROFILE = USER_CACHE / "hardware.yaml"  # what --calibrate writes, and --plan reads without --hardware


def hardware_profile(name: str | None, *, required: bool) -> HardwareProfile | None:
    """``--hardware``'s profile, else this machine's calibrated one; ConfigError when ``required`` and neither."""
    if name is not None:
        return load_hardware(name)
    if DEFAULT_PROFILE.is_file():
        return load_hardware(str(DEFAULT_PROFILE))
    if required:
        raise ConfigError(f"--plan needs a hardware profile: run `python recipes/ppo.py --calibrate` on this machine "
                          f"(writes {DEFAULT_PROFILE}), or pass --hardware h100 or a profile file")
    return None


def calibrate_here(config: str | None, flags: dict) -> Path:
    model_dir = None
    if config is not None:
        from omegaconf import OmegaConf

        raw = OmegaConf.load(config)
        model_dir = resolve_model_path(str(OmegaConf.select(raw, "actor.model_path")))
    device = "cuda" if _cuda() else "cpu"
    profile = calibrate(device, threads=flags.get("--threads", 1), model_dir=model_dir)
    return save_hardware(profile, flags.get("--hardware-out") or DEFAULT_PROFILE)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def plan_command(cfg: RecipeConfig, path: str, overrides: Sequence[str], world_size: int, nodes: int,
                 hardware: HardwareProfile, out: str | None, response_len: int | None = None) -> str:
    result = plan(cfg, world_size, hardware=hardware, nodes=nodes,
                  response_len=float(response_len) if response_len else None)
    text = format_plan(result)
    if result.best is not None:
        target = out or Path(cfg.trainer.output_dir) / f"plan_w{world_size}.yaml"
        written = write_plan(result, path, overrides, target)
        text += (f"\nbest plan written to {written}\n  run it: torchrun --nproc_per_node={world_size // nodes} "
                 f"{'--nnodes=' + str(nodes) + ' ' if nodes > 1 else ''}recipes/ppo.py --config {written}")
    return text


def simulated_lines(cfg: RecipeConfig, world_size: int, hardware: HardwareProfile) -> str:
    """The dry run's time estimate: this config's own mapping through the simulator."""
    if cfg.judge is not None:
        return "simulated time per step: not available (the simulator does not model an LLM judge)"
    estimate = step_estimate(plan_input(cfg).problem, config_mapping(cfg, world_size), hardware, node_size=world_size)
    stages = ", ".join(f"{k} {v:.3g} s" for k, v in estimate.by_stage().items())
    return (f"simulated time per step on {hardware.name} (`torchrlhf.plan`; docs/planning.md says what it models): "
            f"{estimate.seconds:.3g} s ({stages}; bottleneck {estimate.bottleneck})")


__all__ = ["DEFAULT_PROFILE", "calibrate_here", "hardware_profile", "plan_command", "simulated_lines"]
