"""An OpenAI-compatible ``/v1/chat/completions`` for black-box agents, served by a rollout
worker on 127.0.0.1.

Each episode is a session (``engines/agents/sessions.py``) with a base URL of its own,
``http://127.0.0.1:<port>/s/<session id>/v1``, which the agent hands to its ``openai``
client (any api key); the header ``X-Sluice-Session`` names the session as well, on
``/v1/chat/completions``. A call takes the conversation in, continues the session's tokens
(never re-encoding earlier turns), and asks the worker's engine for the reply through
``generate``; the reply comes back in the OpenAI shape, with the sampled token ids and
the policy version under ``sluice`` and per-token log-probs in ``logprobs`` when asked
for. With ``tools`` in the request, the first call renders them into the prompt (as the
template does) and a reply's Hermes tool calls come back as ``tool_calls``. One call at a
time per session (a second one meanwhile is refused with 409); an
unknown or closed session is 404; a call that cannot continue its session is 400 and fails
the episode. ``stream: true`` gets the same reply as server-sent events (OpenAI's
``chat.completion.chunk`` objects, the reply's text in one delta once the engine has
generated it, then ``[DONE]``; usage last with ``stream_options.include_usage``): the
session's tokens are the same either way. ``n`` up to ``MAX_CHOICES`` samples that many
replies, each its own engine request; the session keeps the one the agent continues with
(``engines/agents/sessions.py``). The run samples at its
own temperature (``rollout.temperature``; greedy in held-out evaluation), whatever a
request asks: the trainer's log-prob ratios assume the sampler's. The server runs on
threads of its own, one per call, and stops with ``close``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sluice.engines.agents.chat_template import TurnFormat
from sluice.engines.agents.sessions import ChatSession, ChatSessions, Reply, SessionError
from sluice.envs.tool_calls import ToolCall, parse_tool_calls

log = logging.getLogger(__name__)

_PATH = re.compile(r"^(?:/s/(?P<session>[A-Za-z0-9_.-]+))?/v1/chat/completions/?$")
MAX_BODY = 8 << 20  # a request larger than this is refused unread
MAX_CHOICES = 16  # replies one call may ask for (``n``)


@dataclass(frozen=True)
class Generated:
    """The engine's reply to one call."""

    token_ids: list[int]
    logprobs: list[float]
    version: int
    finished: bool  # False: it stopped at max_tokens


Generate = Callable[[ChatSession, list[int], int, int], "Future[Generated]"]


class CallAbandoned(RuntimeError):
    """The worker gave up the episode a call belongs to (its rollout loop stopped)."""


class _Server(ThreadingHTTPServer):
    # Every episode on the worker may connect at once while the decoding loop holds the
    # GIL: with socketserver's backlog of 5, connections beyond it were reset (the agent
    # saw "Connection error"). The kernel caps this at net.core.somaxconn.
    request_queue_size = 1024
    daemon_threads = True


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class ChatEndpoint:
    """The HTTP server; ``generate(session, input ids, max tokens, choice)`` runs one
    generation in the worker's engine and returns its future (``choice``: which of the
    call's ``n`` replies it is, from 0)."""

    def __init__(
        self,
        sessions: ChatSessions,
        tokenizer: Any,
        generate: Generate,
        model: str = "sluice-policy",
        max_tokens: int = 256,
        call_timeout_s: float = 600.0,
        host: str = "127.0.0.1",
    ) -> None:
        self.turns = TurnFormat(tokenizer)  # TemplateError without a chat template
        self.sessions, self.tokenizer, self.generate = sessions, tokenizer, generate
        self.model, self.max_tokens, self.call_timeout_s = model, max_tokens, call_timeout_s
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                endpoint._post(self)

            def do_GET(self) -> None:
                if self.path.rstrip("/").endswith("/v1/models"):
                    _reply(self, 200, {"object": "list", "data": [{"id": endpoint.model}]})
                else:
                    _reply(self, 404, _error("not found"))

            def log_message(self, format: str, *args: Any) -> None:
                log.debug("chat endpoint: " + format, *args)

        self._server = _Server((host, 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="chat-endpoint", daemon=True
        )
        self._thread.start()

    def base_url(self, session_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/s/{session_id}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _post(self, handler: BaseHTTPRequestHandler) -> None:
        try:
            request, completion = self._complete(handler)
        except _Refused as refused:
            _reply(handler, refused.status, _error(str(refused)))
        except Exception as error:  # a bug here must not leave the agent waiting
            log.exception("chat endpoint call failed")
            _reply(handler, 500, _error(f"{type(error).__name__}: {error}"))
        else:
            if request.get("stream"):
                usage = bool((request.get("stream_options") or {}).get("include_usage"))
                _stream(handler, chunks(completion, usage))
            else:
                _reply(handler, 200, completion)

    def _complete(self, handler: BaseHTTPRequestHandler) -> tuple[dict[str, Any], dict[str, Any]]:
        """The request and its completion."""
        match = _PATH.match(handler.path.split("?", 1)[0])
        if match is None:
            raise _Refused(404, f"no such path {handler.path!r}; POST .../v1/chat/completions")
        session_id = match.group("session") or handler.headers.get("X-Sluice-Session")
        session = self.sessions.get(session_id) if session_id else None
        if session is None:
            raise _Refused(404, f"no open session {session_id!r}: use your episode's base URL")
        request = _body(handler)
        n = request.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
            raise _Refused(400, f"n must be a whole number from 1 to {MAX_CHOICES}, not {n!r}")
        max_tokens = request.get("max_completion_tokens") or request.get("max_tokens")
        max_tokens = int(max_tokens) if max_tokens else self.max_tokens
        if not session.lock.acquire(blocking=False):
            raise _Refused(409, f"session {session_id} has a call running; one at a time")
        try:
            return request, self._call(session, request, max_tokens, n)
        finally:
            session.lock.release()

    def _call(
        self, session: ChatSession, request: dict[str, Any], max_tokens: int, n: int
    ) -> dict[str, Any]:
        tools = request.get("tools") or None
        try:
            ids = session.next_input(request.get("messages"), self.turns, tools)
        except SessionError as error:
            session.failed = str(error)
            raise _Refused(400, str(error)) from None
        answers = [self.generate(session, ids, max_tokens, k) for k in range(n)]
        deadline = time.monotonic() + self.call_timeout_s
        try:
            got = [a.result(timeout=max(deadline - time.monotonic(), 0.0)) for a in answers]
        except CallAbandoned as error:
            raise _Refused(410, str(error)) from None
        replies = [self._reply(session, g, k, tools) for k, g in enumerate(got)]
        session.add_replies(replies)
        choices = []
        for k, (g, reply) in enumerate(zip(got, replies, strict=True)):
            finish = "stop" if g.finished else "length"
            choice: dict[str, Any] = {
                "index": k,
                "message": reply.message,
                "finish_reason": "tool_calls" if "tool_calls" in reply.message else finish,
                "token_ids": g.token_ids,
            }
            if request.get("logprobs"):
                choice["logprobs"] = {
                    "content": [
                        {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(g.token_ids, g.logprobs, strict=True)
                    ]
                }
            choices.append(choice)
        completion_tokens = sum(len(g.token_ids) for g in got)
        return {
            "id": f"chatcmpl-{session.session_id}-{session.calls}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(ids) + completion_tokens,
            },
            "sluice": {"session": session.session_id, "version": got[0].version},
        }

    def _reply(
        self, session: ChatSession, got: Generated, choice: int, tools: list[Any] | None
    ) -> Reply:
        """One sampled reply with its OpenAI message: the text, or the Hermes tool calls in
        it in the OpenAI form."""
        text = self.tokenizer.decode(got.token_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        calls = [c for c in parse_tool_calls(text) if isinstance(c, ToolCall)] if tools else []
        if calls:
            message["content"] = text[: text.find("<tool_call>")].strip() or None
            message["tool_calls"] = [
                {
                    "id": f"call-{session.session_id[:8]}-{session.calls}-{choice}-{k}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for k, c in enumerate(calls)
            ]
        return Reply(got.token_ids, got.logprobs, got.version, text, message)


def chunks(completion: dict[str, Any], usage: bool) -> list[dict[str, Any]]:
    """A completion as the ``chat.completion.chunk`` objects a streamed call gets, choice
    by choice (each chunk names its choice's ``index``): the role, then the content (and
    tool calls, each with its ``index``) with the log-probs, then the finish reason with
    Sluice's token ids and version; then the usage if asked."""
    head = {k: completion[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk"

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": choices, **extra}

    out = []
    for choice in completion["choices"]:
        message, index = choice["message"], choice["index"]
        delta: dict[str, Any] = {}
        if message["content"] is not None:
            delta["content"] = message["content"]
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
        body = {"index": index, "delta": delta, "finish_reason": None}
        if "logprobs" in choice:
            body["logprobs"] = choice["logprobs"]
        first = {"delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        last = {"delta": {}, "finish_reason": choice["finish_reason"]}
        out += [
            chunk([{"index": index, **first}]),
            chunk([body]),
            chunk(
                [{"index": index, **last, "token_ids": choice["token_ids"]}],
                sluice=completion["sluice"],
            ),
        ]
    if usage:
        out.append(chunk([], usage=completion["usage"]))
    return out


def _stream(handler: BaseHTTPRequestHandler, events: list[dict[str, Any]]) -> None:
    """Server-sent events, then ``[DONE]``; the connection's close ends the body (HTTP/1.0)."""
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Cache-Control", "no-cache")
    handler.end_headers()
    for event in events:
        handler.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
    handler.wfile.write(b"data: [DONE]\n\n")


def _body(handler: BaseHTTPRequestHandler) -> dict[str, Any]:
    size = int(handler.headers.get("Content-Length") or 0)
    if size > MAX_BODY:
        raise _Refused(413, f"the request is larger than {MAX_BODY} bytes")
    try:
        body = json.loads(handler.rfile.read(size) or b"{}")
    except json.JSONDecodeError as error:
        raise _Refused(400, f"the request is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise _Refused(400, "the request is not a JSON object")
    return body


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error"}}


def _reply(handler: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
