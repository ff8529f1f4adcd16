"""Agent episodes as chat sessions whose token sequence grows call by call, token-exact.

An agent written against an OpenAI client sends the whole conversation with every call.
A ``ChatSession`` keeps what the engine actually saw and sampled: the first call's messages
rendered with the model's chat template (generation prompt included) and tokenized; after
that, each call must continue the conversation the session holds (the same messages, the
assistant's replies where they were, an empty one possibly left out, then new ones), and
only the new messages are rendered, as the template puts them after a finished assistant
turn (``engines/agents/chat_template.py``): tokenized once and appended with loss mask 0.
Earlier turns are never re-rendered or re-tokenized, so a template that would render a past reply
differently (tool calls, thinking stripped) changes nothing. A call that rewrites the
history is a ``SessionError``; the endpoint answers it with an error and the episode fails.

A call may get several replies (``n > 1``): the first joins the sequence at once, the
others wait as the turn's alternatives, and the next call's copy of the assistant's message
says which one the agent kept (its text and tool calls must be one of the replies'); that
one's tokens then stand in the sequence. An episode that ends on such a turn keeps the
first reply. The replies left out are sampled but never trained: the group is still the
episodes of one problem.

Used by the chat endpoint (``engines/agents/endpoint.py``); nothing here knows HTTP or vLLM.
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from sluice.engines.agents.chat_template import TemplateError, TurnFormat
from sluice.envs import Problem


class SessionError(ValueError):
    """A call that cannot continue its session token-exactly."""


def _plain(messages: Any) -> list[dict[str, Any]]:
    """The messages as dicts a template reads (text content; a tool call's fields kept),
    checked."""
    if not isinstance(messages, list) or not messages:
        raise SessionError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise SessionError(f"message {i} is not an object with a role")
        content = message.get("content")
        if content is None:
            content = ""
        if not isinstance(content, str):  # OpenAI's list-of-parts form: text parts only
            try:
                content = "".join(p["text"] for p in content if p.get("type") == "text")
            except (TypeError, KeyError, AttributeError):
                raise SessionError(f"message {i} has content that is not text") from None
        out.append({**message, "content": content})
    return out


def _same_turn(sent: dict[str, Any], held: dict[str, Any]) -> bool:
    """Whether a message the agent sent again is the one the session holds: the same role,
    and for anything but the assistant's replies (which the agent may hold in its own
    form, a tool call for one) the same text."""
    if sent["role"] != held["role"]:
        return False
    return held["role"] == "assistant" or sent["content"] == held["content"]


_EMPTY_REPLY = {"role": "assistant", "content": ""}


def _continuation(sent: list[dict[str, Any]], held: list[dict[str, Any]]) -> int | None:
    """Where the new messages start in ``sent`` when it repeats the ``held`` conversation;
    None when it does not, or adds nothing. An empty reply of the assistant may be left
    out: agents that keep their history as output items drop a reply with no text and no
    tool call (the OpenAI Agents SDK does); its tokens stay in the sequence as sampled."""
    at = 0
    for message in held:
        if at < len(sent) and _same_turn(sent[at], message):
            at += 1
        elif message["role"] != "assistant" or message["content"].strip():
            return None
    return at if at < len(sent) else None


def _call_key(call: Any) -> tuple[str, Any]:
    """A tool call's name and arguments (parsed when they are a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments)
    return str(function.get("name")), arguments


def _reply_key(message: dict[str, Any]) -> tuple[str, list[tuple[str, Any]]]:
    """What tells an assistant's replies apart as an agent sends them back: the text (no
    text and an empty one alike) and the tool calls' names and arguments."""
    calls = message.get("tool_calls") or []
    return (message.get("content") or "").strip(), [_call_key(c) for c in calls]


@dataclass(frozen=True)
class Reply:
    """One reply the engine sampled for a call: its tokens, their log-probs and version, its
    text, and the message the endpoint answered with (text and tool calls)."""

    token_ids: list[int]
    logprobs: list[float]
    version: int
    text: str
    message: dict[str, Any]


@dataclass
class ChatSession:
    """One episode's conversation and the tokens behind it."""

    session_id: str
    problem: Problem
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    marks: list[tuple[int, int]] = field(default_factory=list)  # (first token, version)
    messages: list[dict[str, Any]] = field(default_factory=list)
    last_reply: list[int] = field(default_factory=list)  # the tokens of the latest reply
    calls: int = 0
    # The latest call's replies when it asked for more than one (n > 1), until the next call
    # says which the agent kept; ``turn`` is where the kept one's tokens and mark start.
    alternatives: list[Reply] = field(default_factory=list)
    turn: tuple[int, int] = (0, 0)  # (len(token_ids), len(marks)) before the latest reply
    closed: bool = False
    failed: str | None = None  # why a call could not continue the session
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def next_input(
        self, messages: Any, turns: TurnFormat, tools: list[Any] | None = None
    ) -> list[int]:
        """The token ids the next generation starts from, once ``messages`` are taken in."""
        plain = _plain(messages)
        if not self.prompt_ids:
            text = turns.first(plain, tools=tools) if tools else turns.first(plain)
            self.prompt_ids = list(turns.tokenizer(text, add_special_tokens=False)["input_ids"])
            self.messages = plain
            return list(self.prompt_ids)
        start = _continuation(plain, self.messages)
        if start is None:
            raise SessionError(
                "the messages do not continue this session: send its earlier messages and "
                "the assistant's replies, then new ones"
            )
        if self.alternatives:  # the latest reply: sent back, or left out when empty
            latest = plain[start - 1]
            self._keep(latest if latest["role"] == "assistant" else _EMPTY_REPLY)
        new = plain[start:]
        if new[0]["role"] == "assistant":
            raise SessionError("a message after the assistant's reply is the assistant's again")
        try:
            text = turns.after_turn(self.last_reply, new)
        except TemplateError as error:
            raise SessionError(str(error)) from None
        added = list(turns.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.token_ids += added
        self.logprobs += [0.0] * len(added)
        self.mask += [0] * len(added)
        self.messages = plain
        return self.prompt_ids + self.token_ids

    def add_replies(self, replies: list[Reply]) -> None:
        """The engine's answers to the call: the first one's tokens join the sequence (mask
        1) and its text the conversation as the assistant's message; more than one wait as
        the turn's alternatives (``_keep``)."""
        self.turn = (len(self.token_ids), len(self.marks))
        self._append(replies[0])
        self.messages.append({"role": "assistant", "content": replies[0].text})
        self.alternatives = list(replies) if len(replies) > 1 else []
        self.calls += 1

    def _append(self, reply: Reply) -> None:
        if not self.marks or self.marks[-1][1] != reply.version:
            self.marks.append((len(self.token_ids), reply.version))
        self.token_ids += reply.token_ids
        self.logprobs += reply.logprobs
        self.mask += [1] * len(reply.token_ids)
        self.last_reply = list(reply.token_ids)

    def _keep(self, sent: dict[str, Any]) -> None:
        """Put the alternative the agent sent back (``sent``, its copy of the assistant's
        message) in the sequence in place of the first reply."""
        key = _reply_key(sent)
        kept = next((r for r in self.alternatives if _reply_key(r.message) == key), None)
        if kept is None:
            raise SessionError(
                "the assistant's message is none of the replies the last call got (n > 1): "
                "send one of them back as it came"
            )
        tokens, marks = self.turn
        del self.token_ids[tokens:], self.logprobs[tokens:], self.mask[tokens:]
        del self.marks[marks:]
        self._append(kept)
        self.alternatives = []


class ChatSessions:
    """The open sessions of one rollout worker, by id; thread-safe."""

    def __init__(self) -> None:
        self._open: dict[str, ChatSession] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str, problem: Problem) -> ChatSession:
        session = ChatSession(session_id, problem)
        with self._lock:
            if session_id in self._open:
                raise ValueError(f"session {session_id} is open already")
            self._open[session_id] = session
        return session

    def get(self, session_id: str) -> ChatSession | None:
        with self._lock:
            return self._open.get(session_id)

    def close(self, session_id: str) -> ChatSession | None:
        with self._lock:
            session = self._open.pop(session_id, None)
        if session is not None:
            session.closed = True
        return session
