"""Tool calls in model output, Hermes/Qwen style, read by our own parser.

A model calls a tool by writing ``<tool_call>{"name": "...", "arguments": {...}}</tool_call>``
(the format Qwen's and Hermes' chat templates describe to the model); a tool's answer goes
back inside ``<tool_response>...</tool_response>``. ``parse_tool_calls`` never raises: a
call that is not closed, not JSON, not an object, or lacks a name or arguments comes back
as a ``BadCall`` with the reason, which the environment shows the model as an error.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_CALL_CHARS = 20_000  # a call longer than this is refused unread


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BadCall:
    """A tool call that could not be read; ``error`` says why, for the model to see."""

    text: str
    error: str


def _read(body: str) -> ToolCall | BadCall:
    text = body.strip()
    if len(text) > MAX_CALL_CHARS:
        return BadCall(text[:100], f"the call is longer than {MAX_CALL_CHARS} characters")
    try:
        call = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as error:
        return BadCall(text, f"the call is not JSON ({error})")
    if not isinstance(call, dict):
        return BadCall(text, 'the call is not a JSON object {"name": ..., "arguments": {...}}')
    name, arguments = call.get("name"), call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return BadCall(text, "the arguments are a string that is not a JSON object")
    if not isinstance(name, str) or not name:
        return BadCall(text, 'the call has no "name"')
    if not isinstance(arguments, dict):
        return BadCall(text, '"arguments" is not a JSON object')
    return ToolCall(name, arguments)


def parse_tool_calls(text: str, max_calls: int = 8) -> list[ToolCall | BadCall]:
    """The tool calls in ``text``, in order (at most ``max_calls``; more is one ``BadCall``)."""
    found: list[ToolCall | BadCall] = [_read(m.group(1)) for m in _CALL.finditer(text)]
    rest = _CALL.sub("", text)
    if OPEN in rest:
        found.append(BadCall(rest[rest.index(OPEN) :][:200], f"a {OPEN} is never closed"))
    if len(found) > max_calls:
        found = [*found[:max_calls], BadCall("", f"more than {max_calls} tool calls in one turn")]
    return found


def tool_response(text: str) -> str:
    """A tool's answer as the model is shown it."""
    return f"<tool_response>\n{text}\n</tool_response>"
