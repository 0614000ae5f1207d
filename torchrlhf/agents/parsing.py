"""Finding tool calls in a model turn's text.

Two formats:

- ``hermes``: ``<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>``,
  as Qwen2.5/3, Hermes and the HF chat templates with a ``tools=`` argument emit them; several
  blocks in one turn are parallel calls.
- ``tags``: ``<calc>2 + 2</calc>``, a tag mapped to a tool whose one string argument is the text
  between the tags (``tags: {calc: calculator}``) — the smallest format a small model picks up
  from one demonstration.

A call that cannot be made (malformed JSON, an unknown tool, wrong arguments, a block that is never
closed) is a `CallError`, not an exception: it becomes an error observation to the model.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchrlhf.agents.tools import Tool


@dataclass(frozen=True)
class ToolCall:
    """A call to run: ``tool(**arguments)``."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CallError:
    """A call that cannot be made; ``message`` is shown to the model."""

    name: str | None
    message: str


class ToolCallParser:
    """Parse a model turn into tool calls (in order of appearance) for a set of tools.

    Args:
        tools: the tools by name.
        format: ``"hermes"`` or ``"tags"``.
        tags: for ``"tags"``: tag name -> tool name (default: each tool's own name as its tag).
    """

    def __init__(self, tools: Mapping[str, Tool], format: str = "hermes", tags: Mapping[str, str] | None = None) -> None:
        if format not in ("hermes", "tags"):
            raise ValueError(f"tool-call format must be 'hermes' or 'tags', got {format!r}")
        self.tools = dict(tools)
        self.format = format
        if format == "tags":
            self.tags = dict(tags) if tags else {name: name for name in self.tools}
            for tag, name in self.tags.items():
                if not re.fullmatch(r"[A-Za-z_][\w.-]*", tag):
                    raise ValueError(f"tag {tag!r} is not a valid tag name")
                if name not in self.tools:
                    raise ValueError(f"tag {tag!r} names tool {name!r}, which is not configured; tools: {sorted(self.tools)}")
                if len(self.tools[name].parameters) < 1:
                    raise ValueError(f"tag {tag!r}: tool {name!r} takes no argument to put the tag's text in")
            names = "|".join(re.escape(t) for t in self.tags)
            self._pattern = re.compile(rf"<({names})>(.*?)(?:</\1>|$)", re.DOTALL)
        elif tags:
            raise ValueError("tags are only used with format 'tags'")

    def parse(self, text: str) -> list[ToolCall | CallError]:
        """The calls in ``text``; an empty list when the turn calls no tool."""
        return self._parse_hermes(text) if self.format == "hermes" else self._parse_tags(text)

    def _parse_tags(self, text: str) -> list[ToolCall | CallError]:
        calls: list[ToolCall | CallError] = []
        for m in self._pattern.finditer(text):
            tag, body = m.group(1), m.group(2)
            name = self.tags[tag]
            if not m.group(0).endswith(f"</{tag}>"):
                calls.append(CallError(name, f"<{tag}> is not closed with </{tag}>"))
                continue
            argument = self.tools[name].parameters[0]
            calls.append(self._checked(name, {argument: body.strip()}))
        return calls

    def _parse_hermes(self, text: str) -> list[ToolCall | CallError]:
        calls: list[ToolCall | CallError] = []
        for block in hermes_blocks(text):
            if block.error is not None:
                calls.append(CallError(block.name, block.error))
                continue
            arguments = block.arguments
            if isinstance(arguments, str):  # some models encode the arguments object as a JSON string
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    pass
            if not isinstance(arguments, dict):
                calls.append(CallError(block.name, f"the arguments of {block.name!r} must be a JSON object"))
                continue
            calls.append(self._checked(block.name, arguments))
        return calls

    def _checked(self, name: str, arguments: dict[str, Any]) -> ToolCall | CallError:
        tool = self.tools.get(name)
        if tool is None:
            return CallError(name, f"unknown tool {name!r}; available tools: {sorted(self.tools)}")
        problem = tool.check_arguments(arguments)
        if problem:
            return CallError(name, problem)
        return ToolCall(name, arguments)


@dataclass(frozen=True)
class HermesBlock:
    """One ``<tool_call>...</tool_call>`` block of a model turn: its span, and its call or why it is not one."""

    start: int
    end: int
    name: str | None = None
    arguments: Any = None  # as the model wrote it: an object, or a JSON string
    error: str | None = None  # not closed, not JSON, not {"name": ..., "arguments": ...}


def hermes_blocks(text: str) -> list[HermesBlock]:
    """The Hermes tool-call blocks of ``text`` in order (one not closed runs to the end): the one scanner that our
    parser and the harness endpoint's OpenAI ``tool_calls`` (which verifiers episodes receive too) read."""
    blocks = []
    for m in re.finditer(r"<tool_call>(.*?)(</tool_call>|$)", text, re.DOTALL):
        if not m.group(2):
            blocks.append(HermesBlock(m.start(), m.end(), error="<tool_call> is not closed with </tool_call>"))
            continue
        try:
            payload = json.loads(m.group(1).strip())
        except json.JSONDecodeError as e:
            blocks.append(HermesBlock(m.start(), m.end(),
                                      error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            blocks.append(HermesBlock(m.start(), m.end(),
                                      error='a tool call must be a JSON object {"name": ..., "arguments": {...}}'))
            continue
        blocks.append(HermesBlock(m.start(), m.end(), payload["name"], payload.get("arguments", {})))
    return blocks


def openai_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A model turn as OpenAI's ``content`` and ``tool_calls`` (``{"id", "type": "function", "function": {"name",
    "arguments": <JSON string>}}``), as vLLM's hermes parser gives them. A block that is no call stays in the
    content, where the reader sees it; with no call the content is the whole text."""
    calls, kept, last = [], [], 0
    for block in hermes_blocks(text):
        if block.error is not None:
            continue
        kept.append(text[last:block.start])
        last = block.end
        arguments = block.arguments
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                      "function": {"name": block.name,
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    if not calls:
        return text, []
    kept.append(text[last:])
    return "".join(kept).strip() or None, calls
