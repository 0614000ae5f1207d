"""The verifiers harness that plays a policy seat: a chat loop in the rollout worker's process (verifiers 0.4).

verifiers 0.4 runs every model call of an episode itself: a *harness* program (usually a subprocess or a
container: ``null`` runs a uv script that streams its requests) posts each turn to verifiers' interception
server, which records it on the trace and forwards it to the run's OpenAI-compatible endpoint. Our endpoint is
the rollout worker's `torchrlhf.agents.harness.HarnessServer`, which samples the policy token-exactly. This
harness runs its loop in-process instead, as verifiers' `Harness.launch` contract allows ("a harness may run its
loop in-process ... as long as every model call goes through ``endpoint`` + ``secret``"): no uv, no subprocess,
no network, and non-streaming requests, which our endpoint answers whole.

A segment (one ``launch``; a resumed exchange is relaunched on the whole conversation, ``SUPPORTS_RESUME``) asks
the model, runs the tool calls of its answer on the task's MCP tool servers and asks again, until an answer has
no tool call. A turn the interception refuses (a limit or a ``@vf.stop`` reached) ends the segment cleanly: the
trace carries the stop condition. Any other failed call is a failed program (``HarnessError`` on the trace).

verifiers finds a harness by a top-level module name whose ``__all__`` exports its class, so `register` aliases
this module as ``torchrlhf_chat`` (the id `torchrlhf.agents.verifiers_env` pins on the policy seat).
"""

from __future__ import annotations

import functools
import json
import ssl
import sys
from contextlib import AsyncExitStack
from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

HARNESS_ID = "torchrlhf_chat"


class TorchrlhfChatHarnessConfig(vf.HarnessConfig):
    """No knobs: the endpoint's sampling settings are the run's (``rollout.*``)."""


class TorchrlhfChatHarness(vf.Harness[TorchrlhfChatHarnessConfig]):
    """Chat turns and MCP tool calls in-process, every model call through the interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: vf.TaskData) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages.extend(message_to_wire(m) for m in prompt or [])
        async with AsyncExitStack() as stack:
            tools, dispatch, servers = [], {}, {}
            if mcp_urls:
                tools, dispatch, servers = await connect_mcp(
                    {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}, stack)
            # no read timeout: our endpoint answers once the engine samples the turn (the agent's timeout bounds it)
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0),
                                                                     verify=_ssl_context()))
            while True:
                body: dict[str, Any] = {"model": ctx.model, "messages": messages}
                if tools:
                    body["tools"] = tools
                reply = await http.post(f"{endpoint.rstrip('/')}/chat/completions", json=body,
                                        headers={"Authorization": f"Bearer {secret}"})
                if reply.status_code != 200:
                    if trace.stop_condition is not None:  # a limit or a @vf.stop refused the turn: the run is over
                        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
                    return vf.ProgramResult(exit_code=1, stdout="",
                                            stderr=f"model call answered {reply.status_code}: {reply.text[:2000]}")
                message = reply.json()["choices"][0]["message"]
                messages.append(message)
                calls = message.get("tool_calls") or []
                if not calls or not dispatch:
                    return vf.ProgramResult(exit_code=0, stdout="", stderr="")
                for call in calls:
                    messages.append({"role": "tool", "tool_call_id": call.get("id"), "name": call["function"]["name"],
                                     "content": await _run_tool(servers, dispatch, call["function"])})


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One SSL context for every segment's client: httpx builds one per client by default, loading the CA bundle
    (0.15 s per client measured on a busy 2-core host), on the event loop that every episode of the process shares."""
    return httpx.create_ssl_context()


async def _run_tool(servers: dict[str, Any], dispatch: dict[str, Any], function: dict[str, Any]) -> Any:
    """One tool call's result, or an error text the model reads (bad arguments, an unknown tool)."""
    name = function.get("name")
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as e:
        return f"error: the tool arguments are not JSON ({e})"
    if not isinstance(arguments, dict):
        return f"error: the tool arguments must be a JSON object, got {type(arguments).__name__}"
    if name not in dispatch:
        return f"error: unknown tool {name!r}; the tools are {sorted(dispatch)}"
    return await call_mcp(servers, dispatch, name, arguments)


def register() -> str:
    """Make this harness importable by its id (verifiers imports a harness by a top-level module name); the id."""
    sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
    return HARNESS_ID


__all__ = ["TorchrlhfChatHarness"]
