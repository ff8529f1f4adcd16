"""Agent episodes as chat sessions whose token sequence grows call by call, token-exact.

An agent written against an OpenAI client sends the whole conversation with every call.
A ``ChatSession`` keeps what the engine actually saw and sampled: the first call's messages
rendered with the model's chat template (generation prompt included) and tokenized; after
that, each call must continue the conversation the session holds (its earlier messages,
then the assistant's reply as the session returned it). Only the new messages are rendered:
the template's text for the whole conversation must begin with the text of the session's
tokens, and the rest (the end of the assistant's turn the model did not sample, the new
messages, the next generation prompt) is tokenized once and appended, with loss mask 0.
Earlier turns are never re-tokenized. A call that rewrites the history, or a template that
renders the assistant's turn as other text than was sampled, is a ``SessionError`` naming
what differs; the endpoint answers it with an error and the episode fails.

Used by the chat endpoint (``engines/chat_endpoint.py``); nothing here knows HTTP or vLLM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from sluice.envs import Problem


class SessionError(ValueError):
    """A call that cannot continue its session token-exactly."""


class ChatTokenizer(Protocol):
    """What a session needs of a Hugging Face tokenizer."""

    chat_template: Any

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...

    def __call__(self, text: str, **kwargs: Any) -> Any: ...


def _plain(messages: Any) -> list[dict[str, Any]]:
    """The messages as plain dicts of the fields a template reads, checked."""
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
        out.append({"role": message["role"], "content": content})
    return out


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
    text: str = ""  # the text of prompt_ids + token_ids, special tokens included
    calls: int = 0
    closed: bool = False
    failed: str | None = None  # why a call could not continue the session
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def next_input(self, messages: Any, tokenizer: ChatTokenizer) -> list[int]:
        """The token ids the next generation starts from, once ``messages`` are taken in."""
        plain = _plain(messages)
        full = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        if not self.prompt_ids:
            self.prompt_ids = list(tokenizer(full, add_special_tokens=False)["input_ids"])
            self.text, self.messages = full, plain
            return list(self.prompt_ids)
        known = len(self.messages)
        if plain[:known] != self.messages:
            raise SessionError(
                "the messages do not continue this session: send its earlier messages and "
                "the assistant's reply unchanged, then the new ones"
            )
        if len(plain) == known:
            raise SessionError("no new message after the assistant's reply")
        if not full.startswith(self.text):
            raise SessionError(
                "the chat template renders the conversation so far as other text than the "
                "tokens sampled (it changes the assistant's turn): cannot continue it "
                "token-exactly"
            )
        added = list(tokenizer(full[len(self.text) :], add_special_tokens=False)["input_ids"])
        self.token_ids += added
        self.logprobs += [0.0] * len(added)
        self.mask += [0] * len(added)
        self.text, self.messages = full, plain
        return self.prompt_ids + self.token_ids

    def add_reply(
        self,
        token_ids: list[int],
        logprobs: list[float],
        version: int,
        reply: str,
        tokenizer: ChatTokenizer,
    ) -> None:
        """The engine's answer to the call: its tokens join the sequence (mask 1), its text
        joins the conversation as the assistant's message."""
        if not self.marks or self.marks[-1][1] != version:
            self.marks.append((len(self.token_ids), version))
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.mask += [1] * len(token_ids)
        self.text += tokenizer.decode(token_ids, skip_special_tokens=False)
        self.messages.append({"role": "assistant", "content": reply})
        self.calls += 1


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
