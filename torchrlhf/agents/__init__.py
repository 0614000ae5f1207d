"""Multi-turn agents: tools, environments and the per-trajectory state machine engines drive.

`Agent` (built from ``rollout.agent`` by `build_agent`) makes one `AgentSession` per trajectory;
an engine samples each model turn, hands it to ``session.end_turn`` and appends the observation
tokens it returns. See `torchrlhf.agents.agent` for the config and `torchrlhf.agents.session` for
the engine protocol. This package does not depend on the engines or the trainer.
"""

from torchrlhf.agents.agent import Agent, AgentSpec, build_agent
from torchrlhf.agents.env import Environment, load_env_factory
from torchrlhf.agents.parsing import CallError, ToolCall, ToolCallParser
from torchrlhf.agents.reference import run_sessions_reference
from torchrlhf.agents.render import ChatRenderer, TokenCheck
from torchrlhf.agents.session import AgentSession, TokenMismatchError, Trajectory, TurnResult
from torchrlhf.agents.tools import BUILTIN_TOOLS, Tool, ToolExecutor, load_tool, load_tools

__all__ = [
    "Agent", "AgentSession", "AgentSpec", "BUILTIN_TOOLS", "CallError", "ChatRenderer", "Environment",
    "TokenCheck", "TokenMismatchError", "Tool", "ToolCall", "ToolCallParser", "ToolExecutor", "Trajectory",
    "TurnResult", "build_agent", "load_env_factory", "load_tool", "load_tools", "run_sessions_reference",
]
