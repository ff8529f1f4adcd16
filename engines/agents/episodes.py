"""Episodes played by a user's agent through the rollout worker's chat endpoint.

``AgentEpisodes`` belongs to one rollout worker. For each sample it opens a chat session
(``engines/agents/sessions.py``) and starts the agent (``envs/agents.py``) with the
session's base URL, the problem's prompt and its fields. The agent's calls reach the
endpoint (``engines/agents/endpoint.py``) on its threads and wait in ``calls``; the worker's
loop starts each in its engine (``take_calls``), feeds it the engine's tokens
(``advance``) and answers it when it finishes. When the agent returns, its session's
tokens, log-probs, loss mask and versions become the sample, with the agent's reward
(``take_finished``). An agent that fails, or never called the endpoint, fails its sample
with the reason.
"""

from __future__ import annotations

import queue
import threading
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sluice.engines.agents.endpoint import CallAbandoned, ChatEndpoint, Generated
from sluice.engines.agents.sessions import ChatSession, ChatSessions
from sluice.engines.protocols import Delta, StreamingRolloutEngine
from sluice.engines.rollout.messages import PartialSample
from sluice.envs import Problem, RewardResult
from sluice.envs.agents import AgentOutcome, AgentPool

CHOICE_SEEDS = 100_003  # a call's k-th reply samples at its first's seed + k times this


@dataclass(frozen=True)
class AgentSpec:
    """The agent a run names (``env.agent``) and how it may run."""

    path: str
    args: dict
    timeout_s: float
    memory_mib: int | None
    roots: tuple[str, ...] = ()


@dataclass
class _Call:
    session: ChatSession
    ids: list[int]
    max_tokens: int
    choice: int  # which of the call's n replies, from 0
    answer: Future[Generated]


@dataclass
class _Reply:
    call: _Call
    version: int
    token_ids: list[int]
    logprobs: list[float]


class AgentEpisodes:
    def __init__(self, spec: AgentSpec, tokenizer: Any, engine: StreamingRolloutEngine) -> None:
        self.engine = engine
        self.sessions = ChatSessions()
        self.pool = AgentPool(
            spec.path, spec.args, spec.timeout_s, spec.memory_mib, 1.0, spec.roots
        )
        self.endpoint = ChatEndpoint(self.sessions, tokenizer, self._enqueue)
        # The one token of a sample whose agent never called (a trajectory needs one; its
        # loss mask is 0, so nothing learns from it).
        eos = getattr(tokenizer, "eos_token_id", None)
        self.filler = eos if isinstance(eos, int) else 0
        self.calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self.replies: dict[str, _Reply] = {}  # engine request id -> the call it answers
        # Agents running: (their outcome, group id, sample, session id).
        self.runs: list[tuple[Future[AgentOutcome], str, PartialSample, str]] = []
        self.wake = threading.Event()  # a call arrived or an agent ended

    def _enqueue(
        self, session: ChatSession, ids: list[int], max_tokens: int, choice: int
    ) -> Future[Generated]:
        answer: Future[Generated] = Future()
        self.calls.put(_Call(session, ids, max_tokens, choice, answer))
        self.wake.set()
        return answer

    def start(self, group_id: str, sample: PartialSample, problem: Problem) -> None:
        session_id = uuid.uuid4().hex
        self.sessions.open(session_id, problem)
        args = {
            **dict(problem.fields),
            "base_url": self.endpoint.base_url(session_id),
            "prompt": problem.prompt,
            "answer": problem.answer,
        }
        run = self.pool.run(args)
        run.add_done_callback(lambda _: self.wake.set())
        self.runs.append((run, group_id, sample, session_id))

    def poll(self, budget: int, temperature: float) -> list[tuple[str, PartialSample]]:
        """Start the calls the endpoint has queued (``take_calls``); the samples whose
        agents have returned (``take_finished``)."""
        self.wake.clear()  # before looking: whatever comes later wakes the next wait
        self.take_calls(budget, temperature)
        return self.take_finished()

    def take_calls(self, budget: int, temperature: float) -> None:
        """Start the calls the endpoint has queued, each within the episode's ``budget``
        of tokens, sampled at the run's ``temperature`` (not the agent's: the trainer's
        log-prob ratios assume the sampler's)."""
        while True:
            try:
                call = self.calls.get_nowait()
            except queue.Empty:
                return
            left = budget - len(call.session.token_ids)
            if left <= 0:  # the episode has used its tokens: an empty reply, cut
                call.answer.set_result(Generated([], [], self.engine.version(), False))
                continue
            request = f"{call.session.session_id}#{call.session.calls}"
            seed = int(call.session.session_id[:8], 16) + call.session.calls
            if call.choice:  # another of the call's n replies: its own request and draw
                request, seed = f"{request}.{call.choice}", seed + CHOICE_SEEDS * call.choice
            version = self.engine.version()  # its tokens' version: the oldest they can have
            self.replies[request] = _Reply(call, version, [], [])
            self.engine.start(
                request,
                call.ids,
                min(call.max_tokens, left),
                temperature,
                seed,
            )

    def advance(self, delta: Delta) -> bool:
        """Take ``delta`` if it belongs to an agent's call (True), answering the call once
        it is finished."""
        reply = self.replies.get(delta.request_id)
        if reply is None:
            return False
        reply.token_ids.extend(delta.token_ids)
        reply.logprobs.extend(delta.logprobs)
        if delta.finished:
            del self.replies[delta.request_id]
            reply.call.answer.set_result(
                Generated(
                    reply.token_ids, reply.logprobs, reply.version, delta.finish_reason == "stop"
                )
            )
        return True

    def take_finished(self) -> list[tuple[str, PartialSample]]:
        """The samples whose agents have returned, made from their sessions (one whose
        agent never called keeps its group's prompt and one filler token, masked out)."""
        done = [entry for entry in self.runs if entry[0].done()]
        if not done:
            return []
        self.runs = [entry for entry in self.runs if not entry[0].done()]
        out = []
        for run, group_id, sample, session_id in done:
            outcome = run.result()
            session = self.sessions.close(session_id)
            assert session is not None
            version = self.engine.version()
            if session.calls:
                sample.prompt_ids = session.prompt_ids
                sample.token_ids, sample.logprobs = session.token_ids, session.logprobs
                sample.mask, sample.marks = session.mask, session.marks
            else:
                sample.token_ids, sample.logprobs, sample.mask = [self.filler], [0.0], [0]
                sample.marks = [(0, version)]
            if outcome.error is not None:
                sample.result = RewardResult(0.0, False, error=outcome.error)
            elif not session.calls:
                sample.result = RewardResult(
                    0.0, False, error="the agent never called its endpoint"
                )
            else:
                sample.result = RewardResult(
                    outcome.reward, outcome.correct, metrics=outcome.metrics
                )
            out.append((group_id, sample))
        return out

    def abandon(self) -> None:
        """Forget every episode under way (the loop that started them raised): stop their
        calls in the engine, answer the queued ones with an error, close their sessions, so
        the next loop starts clean. Their agents' further calls find no session."""
        self.engine.abort(list(self.replies))
        pending = [reply.call for reply in self.replies.values()]
        self.replies.clear()
        while True:
            try:
                pending.append(self.calls.get_nowait())
            except queue.Empty:
                break
        for call in pending:
            call.answer.set_exception(CallAbandoned("the worker's rollout loop stopped"))
        for _, _, _, session_id in self.runs:
            self.sessions.close(session_id)
        self.runs.clear()

    def busy(self) -> bool:
        """Calls are decoding in the engine."""
        return bool(self.replies)

    def close(self) -> None:
        self.endpoint.close()
        self.pool.close()
