"""Multi-turn agents: tools, environments and the per-trajectory state machine engines drive.

`Agent` (built from ``rollout.agent`` by `build_agent`) holds what every trajectory shares; each
trajectory is an `AgentSession(agent, row)`. An engine samples each model turn, hands it to
``session.end_turn`` and appends the observation tokens it returns: natively (the native engine), or
in rounds of single-turn calls (`torchrlhf.generation.session.run_rounds`). See `torchrlhf.agents.agent` for
the config; the sessions implement the engines' `torchrlhf.generation.session.Session` contract. This package
does not depend on the trainer or the rollout schedules.
"""

from torchrlhf.agents.agent import Agent, AgentSpec, build_agent
from torchrlhf.agents.env import Environment, load_env_factory
from torchrlhf.agents.openenv import OpenEnv
from torchrlhf.agents.parsing import CallError, ToolCall, ToolCallParser
from torchrlhf.agents.render import ChatRenderer, TokenCheck
from torchrlhf.agents.session import (
    AGENT_COLUMNS,
    AgentSession,
    TokenMismatchError,
    Trajectory,
    agent_columns,
)
from torchrlhf.agents.tools import BUILTIN_TOOLS, Tool, ToolExecutor, load_tool, load_tools

__all__ = [
    "AGENT_COLUMNS", "Agent", "AgentSession", "AgentSpec", "BUILTIN_TOOLS", "CallError", "ChatRenderer", "Environment", "OpenEnv",
    "TokenCheck", "TokenMismatchError", "Tool", "ToolCall", "ToolCallParser", "ToolExecutor", "Trajectory",
    "agent_columns", "build_agent", "load_env_factory", "load_tool", "load_tools",
]
