"""Token-exact chat rendering: observation turns appended as the chat template's *delta*.

The model's own tokens are never decoded and re-encoded (re-tokenizing them can change the tokens
the policy is trained on). After a model turn, the tokens appended are exactly what the chat
template would add after that assistant message: the rest of its end-of-turn text the model did
not sample itself (for ChatML, the ``\\n`` after ``<|im_end|>``), the observation messages, and the
next assistant header. The delta is found by rendering a fixed stand-in conversation, ``[user,
assistant PLACEHOLDER, *observation]``, and taking the text after the placeholder; it is tokenized
in context (the tokens of the whole stand-in minus those of its head), so tokenizers that merge or
prefix across a boundary still give the tokens a full render would.

`ChatRenderer.check` is the check mode: it re-renders a whole conversation from text and reports
where its tokens differ from the token-exact trajectory (a metric; the session can make it an error).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

_USER_STANDIN = "<<torchrlhf:user>>"
_ASSISTANT_STANDIN = "<<torchrlhf:assistant>>"


def row_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A data row's ``prompt`` as chat messages (copies): a string is one user turn; no prompt is no message
    (each caller decides what an empty conversation becomes)."""
    prompt = row.get("prompt")
    if prompt is None:
        return []
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


@dataclass(frozen=True)
class TokenCheck:
    """Where a re-render of the conversation from text differs from the trajectory's tokens."""

    mismatches: int  # positions that differ, plus trajectory tokens the re-render lacks
    first_mismatch: int | None  # index into prompt + response tokens; None when they agree


class ChatRenderer:
    """Prompt, observation and check rendering for one tokenizer's chat template.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        tools: JSON schemas (OpenAI / HF ``tools=`` format) passed to the template when it uses them.
        observation_role: ``"tool"`` (one tool message per result), ``"user"`` (all results of a turn
            in one user message), or ``"auto"``: ``"tool"`` when the template mentions a tool role,
            else ``"user"`` (SmolLM2's ChatML template has none; it would render an unseen role).
        observation_prefix: put before the content of a user-role observation (e.g. ``"Result: "``).
        max_observation_tokens: an observation's content longer than this is cut and ends with
            ``truncation_marker`` (the marker's tokens count against the limit).
        truncation_marker: the text that marks a truncated observation.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        observation_role: str = "auto",
        observation_prefix: str = "",
        max_observation_tokens: int | None = None,
        truncation_marker: str = " ...[truncated]",
    ) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("ChatRenderer: the tokenizer has no chat template")
        if isinstance(template, Mapping):  # named templates: the default one renders conversations
            template = template.get("default") or next(iter(template.values()))
        if observation_role not in ("auto", "tool", "user"):
            raise ValueError(f"observation_role must be 'auto', 'tool' or 'user', got {observation_role!r}")
        if max_observation_tokens is not None and max_observation_tokens < 1:
            raise ValueError(f"max_observation_tokens must be >= 1, got {max_observation_tokens}")
        self.tokenizer = tokenizer
        self.tools = [dict(t) for t in tools] if tools else None
        self.template_uses_tools = "tools" in template
        if observation_role == "auto":
            observation_role = "tool" if ("'tool'" in template or '"tool"' in template) else "user"
        self.observation_role = observation_role
        self.observation_prefix = observation_prefix
        self.max_observation_tokens = max_observation_tokens
        self.truncation_marker = truncation_marker
        self._marker_ids = self.encode(truncation_marker)
        standin = self.render([{"role": "user", "content": _USER_STANDIN},
                               {"role": "assistant", "content": _ASSISTANT_STANDIN}], add_generation_prompt=False)
        if _ASSISTANT_STANDIN not in standin:
            raise ValueError("ChatRenderer: the chat template dropped the assistant message's content")
        # What the template writes after an assistant message (ChatML: "<|im_end|>\n").
        self._assistant_end = standin[standin.index(_ASSISTANT_STANDIN) + len(_ASSISTANT_STANDIN):]
        if max_observation_tokens is not None and len(self._marker_ids) >= max_observation_tokens:
            raise ValueError(f"max_observation_tokens={max_observation_tokens} leaves no room beside the "
                             f"truncation marker {truncation_marker!r} ({len(self._marker_ids)} tokens)")

    # ------------------------------------------------------------------ text
    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        """The template's text for ``messages`` (with ``tools=`` when the template uses them)."""
        kwargs = {"tools": self.tools} if self.tools and self.template_uses_tools else {}
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode(self, text: str) -> list[int]:
        # A rendered template already holds the special tokens it needs (BOS included).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_tokens(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens of the initial context, ending with the assistant generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    # ------------------------------------------------------------------ observations
    def truncate(self, content: str) -> tuple[str, bool]:
        """``content`` cut to ``max_observation_tokens`` (marker included); whether it was cut."""
        limit = self.max_observation_tokens
        if limit is None:
            return content, False
        ids = self.encode(content)
        if len(ids) <= limit:
            return content, False
        keep = limit - len(self._marker_ids)
        return self.tokenizer.decode(ids[:keep]) + self.truncation_marker, True

    def observation_messages(self, results: Sequence[tuple[str | None, str]]) -> tuple[list[Message], int]:
        """Messages for a turn's observations, ``(tool name or None, content)`` each; how many were truncated."""
        cut = [self.truncate(content) for _, content in results]
        contents = [c for c, _ in cut]
        truncated = sum(t for _, t in cut)
        if self.observation_role == "tool":
            return [{"role": "tool", "content": c, **({"name": name} if name else {})}
                    for (name, _), c in zip(results, contents)], truncated
        return [{"role": "user", "content": self.observation_prefix + "\n".join(contents)}], truncated

    def turn_content(self, model_tokens: Sequence[int]) -> str:
        """A model turn's text as an assistant message's content: decoded, without the end-of-turn token
        it sampled (used only to re-render in check mode, never to make trajectory tokens)."""
        tokens = list(model_tokens)
        if tokens and self._ends_turn(tokens[-1], self._assistant_end):
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens)

    def _ends_turn(self, token: int, end_text: str) -> bool:
        text = self.tokenizer.decode([token])
        return bool(text) and end_text.startswith(text)

    def delta_tokens(self, model_tokens: Sequence[int], messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The tokens to append after a model turn (``model_tokens``, as sampled) for ``messages``.

        They close the model's turn (what of the template's end-of-turn text the model did not
        sample), hold the observation messages, and end with the next assistant header.
        """
        standin = [{"role": "user", "content": _USER_STANDIN}, {"role": "assistant", "content": _ASSISTANT_STANDIN}]
        full = self.render([*standin, *messages], add_generation_prompt=True)
        cut = full.find(_ASSISTANT_STANDIN)
        if cut < 0:
            raise ValueError("ChatRenderer: the chat template dropped the assistant message's content")
        cut += len(_ASSISTANT_STANDIN)
        # The model's last token, if it is the start of the template's end-of-turn text, is already sampled.
        if len(model_tokens) and self._ends_turn(model_tokens[-1], full[cut:]):
            cut += len(self.tokenizer.decode([model_tokens[-1]]))
        head_ids = self.encode(full[:cut])
        full_ids = self.encode(full)
        if full_ids[: len(head_ids)] == head_ids:
            return full_ids[len(head_ids):]
        return self.encode(full[cut:])  # the boundary merged: fall back to the delta's own tokens

    # ------------------------------------------------------------------ check mode
    def check(self, messages: Sequence[Mapping[str, Any]], tokens: Sequence[int]) -> TokenCheck:
        """Compare the tokens of re-rendering ``messages`` from text with the trajectory's ``tokens``.

        ``messages`` is the whole conversation (prompt, decoded model turns, observations) and
        ``tokens`` the trajectory (prompt + response). Tokens the re-render has past the end of the
        trajectory (the template's text after the last model turn) are not counted.
        """
        rendered = self.encode(self.render(messages, add_generation_prompt=False))
        n = min(len(rendered), len(tokens))
        diffs = [i for i in range(n) if rendered[i] != tokens[i]]
        missing = len(tokens) - n
        first = diffs[0] if diffs else (n if missing else None)
        return TokenCheck(mismatches=len(diffs) + missing, first_mismatch=first)
