"""A multi-turn environment's steps, run isolated, off a rollout worker's decoding loop.

The environment is user code: its steps run in a process of their own
(``envs/isolated.py``), which builds the environment from its
``StepSpec`` (the name a run gives it and its arguments) once and calls ``step`` for many
episodes at once: an ``async`` step waits on the process's event loop (thousands may wait
at once), a plain one runs on a thread of its own. ``EpisodeSteps.submit`` sends one step
and returns at once with a ``concurrent.futures.Future``; the rollout worker
(``engines/rollout/worker.py``) keeps decoding the other episodes meanwhile and reads the
future when it is done. Problems, histories and answers cross as JSON; nothing is pickled.

A step never fails the worker: one that raises, returns something that is not a valid
``EnvStep``, runs past ``timeout_s``, or whose process runs out of its ``memory_mib`` or
dies resolves to a ``StepFailed`` with the reason, the worker records that episode as a
failed sample, and a new process takes the later steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sluice.envs import Problem
from sluice.envs.isolated import Answer, IsolatedPool
from sluice.envs.multi_turn import EnvStep, check_step
from sluice.envs.registry import make_env


@dataclass(frozen=True)
class StepSpec:
    """How the step process builds the environment: its name (built-in, entry point or
    ``module:Class``) and arguments as the run gives them, the folders its module imports
    from, and the process's address space in MiB (None: no limit)."""

    env: str
    args: Mapping[str, Any] = field(default_factory=dict)
    roots: tuple[str, ...] = ()
    memory_mib: int | None = None


@dataclass(frozen=True)
class StepFailed:
    reason: str


@dataclass(frozen=True)
class Stepped:
    """A step's answer, or why it failed, and how long it took."""

    outcome: EnvStep | StepFailed
    seconds: float


_ENVIRONMENTS: dict[str, Any] = {}  # in the step process: built once, by spec


async def run_step(env: str, env_args: dict, problem: dict, history: list[str]) -> dict:
    """One step, in the step process: the environment's answer as JSON."""
    key = json.dumps([env, env_args], sort_keys=True)
    if key not in _ENVIRONMENTS:
        _ENVIRONMENTS[key] = make_env(env, **env_args)
    environment = _ENVIRONMENTS[key]
    question = Problem(**problem)
    if inspect.iscoroutinefunction(environment.step):
        step = await environment.step(question, history)
    else:
        step = await asyncio.to_thread(environment.step, question, history)
    if inspect.isawaitable(step):  # a plain function that returned a coroutine
        step = await step
    answer = {f.name: getattr(step, f.name) for f in dataclasses.fields(check_step(step))}
    answer["tool_errors"] = dict(answer["tool_errors"])  # a Counter, say
    return answer


def _stepped(answer: Answer) -> EnvStep | StepFailed:
    """A step's answer as an ``EnvStep``, checked again (the process is untrusted)."""
    why = answer.error
    if why is None:
        if not isinstance(answer.value, dict):
            why = f"the step process answered {type(answer.value).__name__}"
        else:
            try:
                return check_step(EnvStep(**answer.value))
            except (TypeError, ValueError) as error:
                why = str(error)
    return StepFailed(f"environment step: {why}"[:300])


class EpisodeSteps:
    """Runs ``env.step`` calls of the environment ``spec`` names, concurrently, in a
    process of their own, each within ``timeout_s``."""

    def __init__(self, spec: StepSpec, timeout_s: float) -> None:
        self.spec, self.timeout_s = spec, timeout_s
        function = (f"{__name__}:run_step", {"env": spec.env, "env_args": dict(spec.args)})
        self._calls = IsolatedPool([function], 1, timeout_s, spec.memory_mib, spec.roots, "json")

    def submit(self, problem: Problem, history: list[str]) -> Future[Stepped]:
        started = time.monotonic()
        stepped: Future[Stepped] = Future()

        def done(answer: Future[Answer]) -> None:
            stepped.set_result(Stepped(_stepped(answer.result()), time.monotonic() - started))

        problem_json = {f.name: getattr(problem, f.name) for f in dataclasses.fields(problem)}
        problem_json["fields"] = dict(problem.fields)
        args = {"problem": problem_json, "history": list(history)}
        self._calls.run(0, args).add_done_callback(done)
        return stepped

    def close(self) -> None:
        self._calls.close()
