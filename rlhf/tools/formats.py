"""How a model writes tool calls in its text, by ``rollout.tool_format``.

``hermes`` (Qwen2.5/Qwen3 chat templates, NousResearch Hermes)::

    Let me compute it.
    <tool_call>
    {"name": "add", "arguments": {"a": 1, "b": 2}}
    </tool_call>

A format parses one assistant turn into its text and its calls; a call the format cannot read
is kept as a :class:`ToolCall` with ``error`` set, so the model sees what was wrong, and its
text stays in the turn's content (the conversation shows what the model wrote).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """One call of an assistant turn."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (then ``name`` may be empty)."""

    def message(self) -> dict:
        """The call as a chat message's ``tool_calls`` entry (transformers' format)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolFormat(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content without the calls, calls in order)`` of one assistant turn."""


class HermesFormat:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _OPEN = "<tool_call>"

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls: list[ToolCall] = []

        def take(m: re.Match) -> str:
            calls.append(self._call(m.group(1)))
            return "" if calls[-1].error is None else m.group(0)  # unreadable: left in the text

        rest = self._BLOCK.sub(take, text)
        if self._OPEN in self._BLOCK.sub("", rest):  # an opened block the turn never closed
            calls.append(ToolCall("", error="a <tool_call> block is not closed by </tool_call>"))
        return rest.strip(), calls

    @staticmethod
    def _call(body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return ToolCall("", error=f"the call is not valid JSON ({e.msg}): "
                                      f"{body.strip()!r:.200}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", error=f'a call must be {{"name": ..., "arguments": {{...}}}}, '
                                      f'got {body.strip()!r:.200}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            return ToolCall(obj["name"], error=f"arguments of {obj['name']!r} must be a JSON "
                                               f"object, got {args!r:.200}")
        return ToolCall(obj["name"], args)


TOOL_FORMATS: dict[str, ToolFormat] = {"hermes": HermesFormat()}
"""``rollout.tool_format`` name -> parser; :func:`register_format` adds one."""


def register_format(name: str, fmt: ToolFormat) -> None:
    """Make ``rollout.tool_format=<name>`` parse with ``fmt``."""
    if name in TOOL_FORMATS:
        raise ValueError(f"tool format {name!r} is registered already")
    TOOL_FORMATS[name] = fmt


def get_format(name: str) -> ToolFormat:
    if name not in TOOL_FORMATS:
        raise ValueError(f"rollout.tool_format={name!r} is not one of {sorted(TOOL_FORMATS)}")
    return TOOL_FORMATS[name]
