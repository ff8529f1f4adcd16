"""Stateful games as multi-turn environments (``envs/games.py``): TextArena's real games
and gymnasium-style environments, each episode's game kept live or replayed from its
problem, rewards mapped to [0, 1]; and a TextArena episode played through the step
process with the sample runner."""

from __future__ import annotations

import re

import pytest

from sluice.config.tree import ConfigError, load_config
from sluice.driver.environment import make_environment, step_spec
from sluice.engines.rollout.episodes import EpisodeSteps, StepSpec
from sluice.engines.rollout.messages import PartialGroup, PartialSample
from sluice.engines.rollout.sample_runner import Play
from sluice.envs import make_env
from sluice.envs.games import CHAT, GameError
from sluice.envs.multi_turn import EnvStep, EpisodeLimits
from sluice.envs.prompts import training_prompts
from tests.support.bpe_policy import build_bpe_policy
from tests.support.envs import ROOT
from tests.support.skyrl_games import skyrl_rows
from tests.unit.engines.rollout.test_sample_runner import ScriptedEngine

GUESS = {"game": "GuessTheNumber-v0"}


def secret(env, problem) -> int:
    """Binary search through the environment's own steps: the number it was thinking of."""
    low, high, history = 1, 20, []
    while True:
        guess = (low + high) // 2
        history.append(f"[{guess}]")
        step = env.step(problem, history)
        if step.done:
            assert (step.reward, step.correct) == (1.0, True)
            return guess
        history.append(step.observation)
        if "higher" in step.observation:
            low = guess + 1
        else:
            assert "lower" in step.observation, step.observation
            high = guess - 1


def test_textarena_problems_are_seeded_games_split_by_seed() -> None:
    env = make_env("textarena", **GUESS)
    train, again = env.problems("train", 6, 0), env.problems("train", 6, 0)
    heldout = env.problems("heldout", 6, 0)
    assert [p.fields["seed"] for p in train] == [p.fields["seed"] for p in again]
    assert not {p.fields["seed"] for p in train} & {p.fields["seed"] for p in heldout}
    assert all("Guess The Number" in p.prompt and CHAT not in p.fields for p in train)


def test_a_textarena_game_replays_where_its_game_is_not_live() -> None:
    env = make_env("textarena", **GUESS)
    problem = env.problems("train", 1, 3)[0]
    live = secret(env, problem)
    cold = make_env("textarena", **GUESS)  # another process: every step replays
    cold_secret = secret(_Forgetful(cold), problem)
    assert live == cold_secret


class _Forgetful:
    """Forgets every live game before each step."""

    def __init__(self, env) -> None:
        self.env = env

    def step(self, problem, history):
        self.env._live.clear()
        return self.env.step(problem, history)


def test_plain_text_observations_are_set_off_and_chat_ones_are_user_messages() -> None:
    env = make_env("textarena", **GUESS)
    problem = env.problems("train", 1, 0)[0]
    step = env.step(problem, ["[10]"])
    assert step.observation.startswith("\nThe target number is") and step.role is None
    env.render_prompts(lambda messages: f"<user>{messages[0]['content']}</user><bot>")
    chat = env.problems("train", 1, 0)[0]
    assert chat.prompt.startswith("<user>") and chat.fields[CHAT]
    step = env.step(chat, ["[10]"])
    assert step.observation.startswith("The target number is") and step.role == "user"


def test_a_lost_game_is_a_wrong_episode() -> None:
    env = make_env("textarena", **GUESS)
    problem = env.problems("train", 1, 0)[0]
    history: list[str] = []
    for _ in range(20):
        history.append("not a guess")
        step = env.step(problem, history)
        if step.done:
            break
        history.append(step.observation)
    assert step.done and not step.correct and step.reward < 1


def test_a_two_player_game_against_a_fixed_opponent() -> None:
    env = make_env(
        "textarena",
        game="TicTacToe-v0",
        players=2,
        opponent="tests.support.games:first_available",
    )
    problem = env.problems("train", 1, 0)[0]
    assert "Player 0" in problem.prompt
    history, seen = [], problem.prompt
    for _ in range(5):  # the model takes the last free cell, the opponent the first
        history.append(re.findall(r"'(\[\d\])'", seen)[-1])
        step = env.step(problem, history)
        if step.done:
            break
        assert "Player 1 placed" in step.observation
        seen = step.observation
        history.append(seen)
    # O 8, X 0, O 7, X 1, O 6: the bottom row, a win (TextArena's 1)
    assert history[0::2] == ["[8]", "[7]", "[6]"]
    assert (step.done, step.reward, step.correct) == (True, 1.0, True)


def test_textarena_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="unknown TextArena game 'NoSuchGame'"):
        make_env("textarena", game="NoSuchGame")
    with pytest.raises(ValueError, match="needs an opponent"):
        make_env("textarena", game="TicTacToe-v0", players=2)


def test_a_gymnasium_environment_with_the_five_tuple_api() -> None:
    env = make_env("gym", make="tests.support.games:Countdown", make_args={"highest": 4})
    problem = env.problems("train", 1, 0)[0]
    start = int(problem.prompt.rsplit(" ", 1)[1])
    history = []
    for n in range(start, 0, -1):
        history.append(str(n))
        step = env.step(problem, history)
        history.append(step.observation)
    assert (step.done, step.reward, step.correct) == (True, 1.0, True)
    wrong = env.step(problem, [str(start + 1)])
    assert (wrong.done, wrong.reward, wrong.correct) == (True, 0.0, False)


def test_the_four_tuple_api_chat_observations_and_summed_rewards() -> None:
    env = make_env(
        "gym",
        make="tests.support.games:Tally",
        make_args={"turns": 2},
        episode_reward="sum",
        reward_range=[0, 10],
        correct_at=0.5,
    )
    problem = env.problems("train", 1, 0)[0]
    step = env.step(problem, ["abc"])
    assert step.observation == "\nagain\n!" and not step.done
    done = env.step(problem, ["abc", step.observation, "ab"])
    assert (done.done, done.reward, done.correct) == (True, 0.5, True)
    with pytest.raises(GameError, match="outside reward_range"):
        env.step(problem, ["abcdefgh", step.observation, "abcdefgh"])


def test_a_game_that_replays_differently_fails_with_the_reason() -> None:
    env = make_env("gym", make="tests.support.games:Drifting")
    problem = env.problems("train", 1, 0)[0]
    history = ["4"]
    history.append(env.step(problem, history).observation)
    history.append("3")
    env._live.clear()
    with pytest.raises(GameError, match="deterministic"):
        for _ in range(3):  # each replay draws another start
            env.step(problem, history)
            env._live.clear()


def test_a_textarena_episode_through_the_step_process() -> None:
    """The sample runner plays TextArena's game in the environment's own process: the
    scripted model's turns are not guesses, the game ends them, and the episode ends with
    the game's verdict mapped to [0, 1]."""
    env = make_env("textarena", **GUESS)
    limits = EpisodeLimits(max_turns=8)
    steps = EpisodeSteps(StepSpec("textarena", GUESS, (ROOT,)), limits.step_timeout_s)
    problem = env.problems("train", 1, 0)[0]
    samples = [PartialSample(f"{problem.prompt_id}@t", j, 0.0) for j in range(2)]
    groups = {f"{problem.prompt_id}@t": PartialGroup(problem, [1, 2], samples, seed=3)}
    counters: dict[str, float] = {}
    try:
        played = Play(ScriptedEngine(), steps, limits, 200, 1.0, counters).run(groups)
    finally:
        steps.close()
    for sample in played[f"{problem.prompt_id}@t"].samples:
        assert sample.result is not None and sample.result.error is None
        # TextArena's single-player reward for a game given up: its share of the way done
        assert 0 <= sample.result.reward < 1 and not sample.result.correct
        assert len(sample.turns) >= 3  # a model turn, the game's answer, another model turn


def test_a_run_names_the_game_and_its_code_before_it_starts() -> None:
    """The run's checks: a game needs a model folder (the tiny policy learns its start from
    reference episodes), and the folder of a gym factory's module reaches the step process."""
    cfg = load_config(
        None, ["env.name=gym", "env.args.make=tests.support.games:Countdown", "mode=sync"]
    )
    with pytest.raises(ConfigError, match=r"set policy\.path to a model folder"):
        make_environment(cfg.env, cfg.policy)
    spec = step_spec(cfg)
    assert spec is not None and spec.env == "gym" and ROOT in spec.roots


def test_skyrl_gym_episodes_on_skyrl_data(tmp_path) -> None:
    """skyrl-gym's own multi-turn GSM8K environment on rows in SkyRL's format, read by the
    run's data code and rendered with a model folder's chat template: a right answer ends
    the episode, a wrong one gets the environment's next message, in the step process too."""
    skyrl_rows(tmp_path / "train.jsonl", 40)
    folder = build_bpe_policy(tmp_path / "policy")
    cfg = load_config(
        None,
        [
            "env.name=skyrl_gym",
            f"env.data.path={tmp_path / 'train.jsonl'}",
            f"policy.path={folder}",
            "mode=sync",
        ],
    )
    env, _ = make_environment(cfg.env, cfg.policy)
    train, heldout = env.problems("train", 3, 0), env.problems("heldout", 1, 0)
    assert train and heldout and train[0].prompt.startswith("<|im_start|>user\nWhat is")
    streamed = training_prompts(env, 8, 0).take(2)
    assert all(p.fields["chat"] and p.prompt.startswith("<|im_start|>") for p in streamed)
    problem = train[0]
    truth = problem.fields["skyrl_row"]["reward_spec"]["ground_truth"]
    right = env.step(problem, [f"So: #### {truth}"])
    assert (right.done, right.reward, right.correct) == (True, 1.0, True)
    wrong = env.step(problem, ["#### 999"])
    assert not wrong.done and wrong.role == "user" and "####" in wrong.observation
    spec = step_spec(cfg)
    assert spec is not None
    steps = EpisodeSteps(spec, 30.0)
    try:
        second = steps.submit(problem, ["#### 999", wrong.observation, f"#### {truth}"]).result()
    finally:
        steps.close()
    assert isinstance(second.outcome, EnvStep), second
    assert (second.outcome.done, second.outcome.correct) == (True, True)
    own = make_env("skyrl_gym", env_class="tests.support.skyrl_games:SaysTheAnswer")
    own.render_prompts(lambda messages: messages[-1]["content"])
    assert env.data is not None
    asked = own.first_prompt(env.data.problems("train", 1, 0)[0])  # the same row, own class
    nudge = own.step(asked, ["no idea"])
    assert (nudge.done, nudge.observation, nudge.role) == (False, "not yet", "tool")
    said = own.step(asked, ["no idea", nudge.observation, f"it is {truth}"])
    assert (said.done, said.correct) == (True, True)
    with pytest.raises(ValueError, match=r"env\.data \(the data file\)"):
        load_config(None, ["env.name=skyrl_gym", "mode=sync"])


def test_an_openenv_environment_in_the_step_process() -> None:
    """An environment written with openenv-core's API: its declared action type takes the
    model's turn, its observation's text field is the next message, and its reward ends
    the episode, both in-process and through the step process."""
    args = {"environment": "tests.support.openenv_games:WordLength"}
    env = make_env("openenv", **args)
    problem = env.problems("train", 1, 0)[0]
    length = int(problem.prompt.split()[3])
    missed = env.step(problem, ["x" * (length + 1)])
    assert (missed.done, missed.observation) == (False, f"\nno: {length} letters")
    right = env.step(problem, ["x" * (length + 1), missed.observation, "y" * length])
    assert (right.done, right.reward, right.correct) == (True, 1.0, True)
    steps = EpisodeSteps(StepSpec("openenv", args, (ROOT,)), 30.0)
    try:
        moved = steps.submit(problem, ["x" * (length + 1), missed.observation, "y" * length])
        outcome = moved.result().outcome
    finally:
        steps.close()
    assert isinstance(outcome, EnvStep) and (outcome.done, outcome.correct) == (True, True)
    with pytest.raises(ValueError, match="not an OpenEnv Environment class"):
        make_env("openenv", environment="tests.support.games:Countdown")


@pytest.mark.parametrize(
    "name, args",
    [
        ("textarena", GUESS),
        ("gym", {"make": "tests.support.games:Countdown"}),
        ("openenv", {"environment": "tests.support.openenv_games:WordLength"}),
        ("skyrl_gym", {"env_class": "tests.support.skyrl_games:SaysTheAnswer"}),
    ],
)
def test_a_game_environment_reaches_a_rollout_worker(name, args) -> None:
    """Ray sends the run's environment to each rollout worker by its serializer: a game
    environment crosses without its live games (this process's), and plays there."""
    from ray import cloudpickle

    env = make_env(name, **args)
    env.render_prompts(lambda messages: messages[-1]["content"])
    copy = cloudpickle.loads(cloudpickle.dumps(env))
    assert not copy._live and copy._render is not None
    if name == "skyrl_gym":
        return  # its problems are a data file's rows (test_skyrl_gym_episodes_on_skyrl_data)
    problem = env.problems("train", 1, 0)[0]
    assert copy.problems("train", 1, 0) == [problem]
    assert isinstance(copy.step(problem, ["12"]), EnvStep)
