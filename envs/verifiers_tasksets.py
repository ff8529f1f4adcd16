"""verifiers environments (``env.name: verifiers``; the ``verifiers`` package, 0.4's
``verifiers.v1`` API, ``pip install 'sluice[envs]'``).

    env:
      name: verifiers
      args:
        taskset: my-taskset              # an installed taskset package, by its id
        taskset_args: {}                 # the taskset's own settings
        max_turns: 8                     # model turns of one episode
      agent_timeout_s: 300
    policy:
      path: models/smollm2-135m-instruct # a chat template is required

A verifiers environment is a taskset (its tasks and their ``@vf.reward`` functions), the
harness that plays a task against an OpenAI-compatible endpoint, and the ``Env`` that
makes one episode of a task. Here:

* **Problems** are the taskset's tasks: a task's prompt (its system prompt and prompt, as
  chat messages) rendered with the model's chat template, the task itself as JSON in the
  problem's ``task`` field; a task's key (verifiers' hash of its data) decides its split.
* **Episodes** are played by ``play``, the run's agent (``env.agent``, set by the config):
  in the agent's isolated process it rebuilds the task and runs verifiers' own episode
  (``Env.run_episode``) with the model at the episode's endpoint, so the trajectory is
  token-exact as for any agent; the episode's reward is the trace's weighted reward, its
  ``@vf.metric`` values the episode's metrics. An episode verifiers marks failed (a
  harness, model or scoring error) is a failed sample with the reason.
* **The harness** is the taskset's own when its package exports one, else
  ``SluiceChat``: one reply to the task's messages, asked for in the agent's process.
  verifiers' built-in harnesses (``bash``, ``null``) install their program with ``uv``
  from PyPI, and its MCP tool servers need a harness that speaks MCP, so neither runs
  offline; tools come with a taskset's own harness.
* **Runtime**: verifiers' ``subprocess`` runtime, on this machine; its sandboxes (Docker,
  Prime, Modal, E2B) are not used.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

from sluice.envs.base import Problem, RewardResult, Split, check_split, split_of

Renderer = Callable[[list[dict[str, Any]]], str]
HARNESS_ID = "sluice_verifiers_chat"
"""The id verifiers loads ``SluiceChat`` by (a module of that name, registered on use)."""
MODEL = "policy"
"""The model name the harness asks for (the endpoint serves the run's policy by any name)."""


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ValueError(
            f"the verifiers environment needs the verifiers package ({error}); install it "
            "with pip install 'sluice[envs]'"
        ) from None
    return vf


def _register_harness() -> None:
    """Make ``SluiceChat`` loadable by verifiers' id-based loader: a top-level module
    exporting exactly one Harness subclass."""
    if HARNESS_ID in sys.modules:
        return
    module = types.ModuleType(HARNESS_ID)
    module.SluiceChat = _sluice_chat()  # type: ignore[attr-defined]
    module.__all__ = ["SluiceChat"]  # type: ignore[attr-defined]
    sys.modules[HARNESS_ID] = module


def _sluice_chat() -> type:
    vf = _vf()
    from openai import AsyncOpenAI
    from verifiers.v1.dialects.chat import message_to_wire

    harness: Any = vf.Harness[vf.HarnessConfig]

    class SluiceChat(harness):
        """One reply to the task's messages, asked for in-process (a taskset with tools
        brings a harness of its own)."""

        APPENDS_SYSTEM_PROMPT = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
            if mcp_urls:
                raise RuntimeError(
                    "the task's tools are MCP servers, which Sluice's chat harness does not "
                    "speak; give the taskset a harness of its own"
                )
            system, prompt = self.resolve_prompt(data)
            messages: list[Any] = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            else:
                messages += [message_to_wire(m) for m in prompt]
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            try:
                await client.chat.completions.create(model=ctx.model, messages=messages)
            finally:
                await client.close()
            return vf.ProgramResult(exit_code=0, stdout="", stderr="")

    return SluiceChat


def task_messages(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A task's prompt as chat messages: its system prompt, then its prompt."""
    messages: list[dict[str, Any]] = []
    if data.get("system_prompt"):
        messages.append({"role": "system", "content": str(data["system_prompt"])})
    prompt = data.get("prompt")
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    else:
        messages += [dict(m) for m in prompt or []]
    return messages


def _env_config(
    taskset: str, taskset_args: Mapping[str, Any], harness: str | None, max_turns: int
) -> Any:
    vf = _vf()
    _register_harness()
    from verifiers.v1.utils.loaders import default_harness_id

    if harness is None and default_harness_id(taskset) == "bash":  # no harness of its own
        harness = HARNESS_ID
    agent = vf.AgentConfig(
        runtime=vf.SubprocessConfig(),
        max_turns=max_turns,
        harness=None if harness is None else {"id": harness},
    )
    return vf.SingleAgentEnvConfig(taskset={"id": taskset, **taskset_args}, agent=agent)


class VerifiersEnv:
    """The tasks of a verifiers taskset (see the module's docstring)."""

    def __init__(
        self,
        taskset: str,
        taskset_args: Mapping[str, Any] | None = None,
        harness: str | None = None,
        max_turns: int = 8,
        max_tasks: int = 100_000,
    ) -> None:
        vf = _vf()
        self.name = f"verifiers/{taskset}"
        config = _env_config(taskset, dict(taskset_args or {}), harness, max_turns)
        env = vf.load_environment(config)
        self.tasks = [t.data.model_dump(mode="json") for t in env.taskset.take(max_tasks)]
        keys = [
            hashlib.sha256(json.dumps(t, sort_keys=True).encode()).hexdigest() for t in self.tasks
        ]
        self.splits = [split_of(self.name, key) for key in keys]
        self.keys = keys
        self._render: Renderer | None = None

    def render_prompts(self, render: Renderer | None) -> None:
        self._render = render

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        checked = check_split(split)
        if self._render is None:
            raise ValueError(
                f"{self.name}: a verifiers task is chat messages; set policy.path to a model "
                "folder with a chat template"
            )
        chosen = [i for i, s in enumerate(self.splits) if s == checked]
        random.Random(seed).shuffle(chosen)
        return [
            Problem(
                prompt_id=f"{self.name}/{checked}/{self.keys[i][:16]}",
                env=self.name,
                prompt=self._render(task_messages(self.tasks[i])),
                answer="",
                split=checked,
                fields={"task": self.tasks[i]},
            )
            for i in chosen[:n]
        ]

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        return RewardResult(0.0, False, error=f"{self.name}: scored by its episodes (play)")


_ENVS: dict[str, Any] = {}  # in the agent's process: one verifiers Env per setting


async def play(
    base_url: str,
    task: Mapping[str, Any] | None = None,
    taskset: str = "",
    taskset_args: Mapping[str, Any] | None = None,
    harness: str | None = None,
    max_turns: int = 8,
    max_tasks: int = 100_000,
) -> dict[str, float]:
    """One verifiers episode of ``task`` against the endpoint at ``base_url``: its
    reward and metrics (the agent ``env.name: verifiers`` runs)."""
    vf = _vf()
    if task is None:
        raise ValueError("play needs the problem's task (env.name: verifiers sets it)")
    key = json.dumps([taskset, taskset_args, harness, max_turns], sort_keys=True, default=str)
    if key not in _ENVS:
        config = _env_config(taskset, dict(taskset_args or {}), harness, max_turns)
        _ENVS[key] = vf.load_environment(config)
    env = _ENVS[key]
    task_cls = type(env.taskset).task_type()
    rebuilt = task_cls(task_cls.data_type().model_validate(dict(task)), env.config.taskset.task)
    ctx = vf.ModelContext(
        model=MODEL,
        client=vf.EvalClientConfig(base_url=base_url, api_key_var="SLUICE_VERIFIERS_KEY"),
        sampling=vf.SamplingConfig(),
    )
    episode = await env.run_episode(rebuilt, ctx)
    errors = [e.message for e in episode.errors] + [
        e.message for trace in episode.traces for e in trace.errors
    ]
    if not episode.ok or errors:
        raise RuntimeError(f"the verifiers episode failed: {'; '.join(errors)[:300]}")
    (trace,) = episode.traces
    out = {"reward": float(trace.reward)}
    for name, value in (trace.metrics or {}).items():
        if isinstance(value, int | float):
            out[name] = float(value)
    return out
