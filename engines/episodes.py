"""A multi-turn environment's steps, run off a rollout worker's decoding loop.

``EpisodeSteps`` holds one event loop on a thread of its own. ``submit`` schedules one
environment step there and returns at once with a ``concurrent.futures.Future``: an
``async`` step waits on the loop (thousands may wait at once, costing no thread), a plain
one runs on the loop's thread pool. The rollout worker (``engines/rollout_worker.py``)
keeps decoding the other episodes while a step runs and reads the future when it is done.

A step never fails the worker: one that raises, returns something that is not an
``EnvStep``, or runs past ``timeout_s`` resolves to a ``StepFailed`` with the reason, and
the worker records that episode as a failed sample. A plain step that hangs keeps its
pool thread (Python cannot stop a thread); its episode has failed by then.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from sluice.envs import Problem
from sluice.envs.multi_turn import EnvStep, MultiTurn, check_step

STEP_THREADS = 64  # plain (not async) steps running at once on one worker


@dataclass(frozen=True)
class StepFailed:
    reason: str


@dataclass(frozen=True)
class Stepped:
    """A step's answer, or why it failed, and how long it took."""

    outcome: EnvStep | StepFailed
    seconds: float


class EpisodeSteps:
    """Runs ``env.step`` calls concurrently on an event loop thread, each within
    ``timeout_s``."""

    def __init__(self, env: MultiTurn, timeout_s: float) -> None:
        self.env, self.timeout_s = env, timeout_s
        self._loop = asyncio.new_event_loop()
        # Plain steps that wait (a tool's latency) each hold a thread while they wait.
        self._loop.set_default_executor(ThreadPoolExecutor(STEP_THREADS, "env-step"))
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="env-steps", daemon=True
        )
        self._thread.start()

    async def _step(self, problem: Problem, history: list[str]) -> Stepped:
        started = time.monotonic()
        try:
            if inspect.iscoroutinefunction(self.env.step):
                pending = self.env.step(problem, history)
            else:
                pending = asyncio.to_thread(self.env.step, problem, history)
            step = await asyncio.wait_for(pending, self.timeout_s)  # type: ignore[arg-type]
            if inspect.isawaitable(step):  # a plain function that returned a coroutine
                step = await asyncio.wait_for(step, self.timeout_s)
            outcome: EnvStep | StepFailed = check_step(step)
        except TimeoutError:
            outcome = StepFailed(f"environment step timed out after {self.timeout_s:g} s")
        except Exception as error:
            outcome = StepFailed(f"environment step raised {type(error).__name__}: {error}"[:300])
        return Stepped(outcome, time.monotonic() - started)

    def submit(self, problem: Problem, history: list[str]) -> Future[Stepped]:
        return asyncio.run_coroutine_threadsafe(self._step(problem, history), self._loop)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
