"""A rollout loop that raises leaves none of its agent episodes behind: their calls in the
engine are aborted, the agents' waiting calls answered with an error, their sessions
closed; the worker's next loop plays its own episodes and finds nothing of the old ones,
sampling at the run's temperature.
A real agent process (``tests/support/agents.py:two_turns``) and endpoint, a scripted
engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.engines.agents.episodes import AgentEpisodes, AgentSpec
from sluice.engines.protocols import Delta
from sluice.engines.rollout.messages import PartialGroup, PartialSample
from sluice.engines.rollout.sample_runner import Play
from sluice.envs import AdditionEnv
from sluice.envs.multi_turn import EpisodeLimits
from sluice.policy.starting import CHAT_TEMPLATE, EOS_ID, build_tokenizer

ROOT = str(Path(__file__).parents[4])


class Engine:
    """Replies "7" then EOS, a token a step; ``broken``: its step raises."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.broken = tokenizer, False
        self.live: dict[str, int] = {}
        self.aborted: list[str] = []
        self.temperatures: list[float] = []

    def version(self) -> int:
        return 0

    def start(self, request_id, prompt_ids, max_new_tokens, temperature, seed) -> None:
        self.live[request_id] = 0
        self.temperatures.append(temperature)

    def step(self) -> list[Delta]:
        if self.broken:
            raise RuntimeError("the engine broke")
        out = []
        for request, n in list(self.live.items()):
            token = self.tokenizer.convert_tokens_to_ids("7") if n == 0 else EOS_ID
            out.append(Delta(request, [token], [-0.1], n == 1, "stop"))
            self.live[request] = n + 1
            if n == 1:
                del self.live[request]
        return out

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        for request in request_ids:
            self.live.pop(request, None)

    def decode(self, token_ids) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def groups(tag: str) -> dict[str, PartialGroup]:
    problem = AdditionEnv(scratch=False).problems("train", 1, seed=0)[0]
    group = f"{problem.prompt_id}@{tag}"
    return {group: PartialGroup(problem, [1], [PartialSample(group, 0, 0.0)], seed=0)}


def test_a_loop_that_raises_leaves_no_agent_episode_behind():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = Engine(tokenizer)
    spec = AgentSpec("tests.support.agents:two_turns", {}, 30.0, None, (ROOT,))
    agents = AgentEpisodes(spec, tokenizer, engine)
    try:
        engine.broken = True
        with pytest.raises(RuntimeError, match="the engine broke"):
            Play(engine, None, EpisodeLimits(), 40, 1.0, {}, agents).run(groups("a"))
        assert len(engine.aborted) == 1 and not engine.live  # the agent's first call
        assert agents.runs == [] and agents.replies == {}
        assert agents.sessions.get(engine.aborted[0].split("#")[0]) is None

        engine.broken, engine.temperatures = False, []
        played = Play(engine, None, EpisodeLimits(), 40, 0.25, {}, agents).run(groups("b"))
        (sample,) = next(iter(played.values())).samples
        assert sample.result is not None and sample.result.error is None, sample.result
        assert sample.result.metrics == {"calls": 2.0}
        assert sample.token_ids[:2] == [tokenizer.convert_tokens_to_ids("7"), EOS_ID]
        assert engine.temperatures == [0.25, 0.25]  # the run's, whatever the agent asks
    finally:
        agents.close()
