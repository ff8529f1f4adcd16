"""Multi-turn episodes in the sample runner, with a scripted engine and the environments'
steps in their own process (``tests/support/envs.py``): the trajectory is the sampled tokens
plus the environment's tokens, masked; limits end episodes; an environment that raises,
hangs, answers nonsense or runs out of memory fails its episode and nothing else."""

from __future__ import annotations

import pytest

from sluice.engines.protocols import Delta
from sluice.engines.rollout.episodes import EpisodeSteps
from sluice.engines.rollout.messages import PartialGroup, PartialSample
from sluice.engines.rollout.sample_runner import Play
from sluice.engines.rollout.scored import played_block
from sluice.envs.multi_turn import EpisodeLimits
from sluice.rl.advantages import Credit
from sluice.storage.schema import validate_batch
from tests.support.envs import Broken, Endless, TwoTurns, spec


class ScriptedEngine:
    """Each request samples ``turn_tokens`` tokens (ids 100+), one per step, then stops;
    text is one character per token; the environment's text encodes to ids 1000+."""

    def __init__(self, turn_tokens: int = 3) -> None:
        self.turn_tokens, self.started, self.live = turn_tokens, [], {}
        self.counter = 0

    def version(self) -> int:
        return 7

    def start(self, request_id, prompt_ids, max_new_tokens, temperature, seed) -> None:
        self.started.append((request_id, list(prompt_ids), max_new_tokens))
        self.live[request_id] = min(self.turn_tokens, max_new_tokens)

    def step(self) -> list[Delta]:
        out = []
        for request, left in list(self.live.items()):
            self.counter += 1
            done = left == 1
            out.append(Delta(request, [100 + self.counter % 50], [-0.5], done, "stop"))
            self.live[request] = left - 1
            if done:
                del self.live[request]
        return out

    def decode(self, token_ids) -> str:
        return "".join(chr(65 + t % 26) for t in token_ids if t < 1000)

    def encode(self, text: str) -> list[int]:
        return [1000 + ord(c) for c in text]


def play(env, limits=None, n=2, max_new_tokens=40, memory_mib=None, **args):
    limits, engine = limits or EpisodeLimits(), ScriptedEngine()
    steps = EpisodeSteps(spec(env, memory_mib, **args), limits.step_timeout_s)
    counters: dict[str, float] = {}
    groups = {}
    for problem in env.problems("train", 2, 0):
        samples = [PartialSample(f"{problem.prompt_id}@t", j, 0.0) for j in range(n)]
        groups[f"{problem.prompt_id}@t"] = PartialGroup(problem, [1, 2], samples, seed=3)
    try:
        played = Play(engine, steps, limits, max_new_tokens, 1.0, counters).run(groups)
    finally:
        steps.close()
    return played, engine, counters


def test_an_episode_is_the_sampled_tokens_then_the_environments_masked_tokens():
    env = TwoTurns("ok!")
    played, engine, counters = play(env)
    obs = ScriptedEngine().encode("ok!")
    for group in played.values():
        for sample in group.samples:
            first, second = sample.token_ids[:3], sample.token_ids[6:]
            assert sample.token_ids == [*first, *obs, *second] and len(second) == 3
            assert sample.mask == [1, 1, 1, 0, 0, 0, 1, 1, 1]
            assert sample.logprobs == [-0.5] * 3 + [0.0] * 3 + [-0.5] * 3
            assert sample.result is not None and sample.result.correct
    # The second turn continues from the whole sequence, not from re-encoded text.
    second_turns = [(r, ids) for r, ids, _ in engine.started if r.endswith("#2")]
    assert len(second_turns) == 4
    for request, ids in second_turns:
        sample = next(
            s
            for g in played.values()
            for s in g.samples
            if request.startswith(f"{s.group}/{s.index}")
        )
        assert ids == [1, 2, *sample.token_ids[:6]]
    # The environment was sent each turn as text decoded from the sampled tokens.
    decode = ScriptedEngine().decode
    samples = [s for g in played.values() for s in g.samples]
    assert all(
        s.turns == [decode(s.token_ids[:3]), "ok!", decode(s.token_ids[6:])] for s in samples
    )
    assert counters["env_steps"] == 8 and counters["tool_calls"] == 4
    assert counters["tool_errors/error"] == 4 and counters["env_tokens"] == 12


def test_played_episodes_become_rows_with_a_loss_mask_and_the_environments_reward():
    played, _, _ = play(TwoTurns())
    block, stats = played_block("two-turns", played, credit=Credit(scale_by_std=False))
    validate_batch(block)
    assert block.column("loss_mask").to_pylist() == [[1, 1, 1, 0, 0, 0, 1, 1, 1]] * 4
    assert block.column("reward").to_pylist() == [1.0] * 4
    assert block.column("token_versions").to_pylist() == [[7] * 9] * 4
    assert stats.correct == 4


def test_an_episode_out_of_turns_or_tokens_ends_unsolved():
    played, _, counters = play(Endless(), EpisodeLimits(max_turns=3))
    for group in played.values():
        for sample in group.samples:
            assert (len(sample.turns) + 1) // 2 == 3  # three model turns, two observations
            assert sample.result is not None and not sample.result.correct
            assert sample.result.error is None
    assert counters["episodes_cut"] == 4
    played, _, _ = play(Endless(), EpisodeLimits(max_turns=50), max_new_tokens=20)
    for group in played.values():
        for sample in group.samples:
            assert len(sample.token_ids) <= 20
    turn_budgets = {m for r, _, m in play(Endless(), EpisodeLimits(max_turn_tokens=2))[1].started}
    assert turn_budgets == {2}


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("raise", "environment step: raised KeyError"),
        ("hang", "environment step: timed out after 0.3 s"),
        ("nan", "not a number in [0, 1]"),
        ("junk", "step returned str, not EnvStep"),
        ("memory", "environment step: memory limit"),
    ],
)
def test_an_environment_that_fails_fails_only_its_episodes(how, reason):
    played, _, _ = play(Broken(how), EpisodeLimits(step_timeout_s=0.3), memory_mib=2048, how=how)
    failed = [s.result for s in played["p0@t"].samples]
    assert all(r is not None and r.error is not None and reason in r.error for r in failed)
    assert [s.result.reward for s in played["p1@t"].samples] == [0.5, 0.5]


def test_a_kept_episode_goes_on_where_it_stood():
    """Groups kept across a resume (or repacked): an episode whose model turn had ended
    asks its environment again; one cut in the middle of a turn decodes on from its tokens."""
    env, engine = TwoTurns("ok!"), ScriptedEngine()
    steps = EpisodeSteps(spec(env, None), EpisodeLimits().step_timeout_s)
    problem = env.problems("train", 1, 0)[0]
    turn = [100, 101, 102]
    waiting = PartialSample(
        "g", 0, 0.0, token_ids=list(turn), logprobs=[-0.5] * 3, turns=[engine.decode(turn)]
    )
    midway = PartialSample("g", 1, 0.0, token_ids=[100, 101], logprobs=[-0.5] * 2)
    group = PartialGroup(problem, [1, 2], [waiting, midway], seed=3)
    try:
        played = Play(engine, steps, EpisodeLimits(), 40, 1.0, {}).run({"g": group})["g"]
    finally:
        steps.close()
    obs = engine.encode("ok!")
    waited, continued = played.samples
    assert waited.token_ids[:6] == [*turn, *obs] and len(waited.token_ids) == 9
    assert waited.mask == [1, 1, 1, 0, 0, 0, 1, 1, 1] and waited.result.correct
    starts = {request: ids for request, ids, _ in engine.started}
    assert "g/0" not in starts and starts["g/0#2"] == [1, 2, *turn, *obs]
    assert starts["g/1"] == [1, 2, 100, 101]  # its turn goes on from its two tokens
    assert continued.token_ids[:2] == [100, 101] and continued.turns[0] == engine.decode(
        continued.token_ids[:5]
    )
    assert continued.result.correct
