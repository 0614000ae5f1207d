"""The auto device mapping: a planner that places every role and picks its layout, micro-batches and schedule for a
cluster, from a simulator of one RL step calibrated on the user's hardware (HybridFlow §6).

    python recipes/ppo.py --config X.yaml --plan --world-size 8 [--nodes 1] [--hardware h100|FILE]
    python recipes/ppo.py --calibrate [--hardware-out FILE]

Layers: `hardware` (profiles), `simulate` (pure arithmetic of a step), `memory` (traced micro-batch memory at any
depth and size; `trace_cache` keeps the traces on disk), `problem` (a config read once), `search` (enumeration,
pruning, ranking, the written candidate's check), `auto` (the entry point: table and written config), `calibrate`
(probes that write a profile).
"""

from torchrlhf.plan.auto import format_plan, plan, write_plan
from torchrlhf.plan.hardware import HardwareProfile, load_hardware

__all__ = ["HardwareProfile", "format_plan", "load_hardware", "plan", "write_plan"]
