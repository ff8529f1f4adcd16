"""Stateful games as multi-turn environments: the shared core of the adapters for
TextArena, gymnasium-style text environments, skyrl-gym and OpenEnv.

Those libraries' environments hold their state in an object (``reset``, then ``step``
after ``step``); Sluice's ``MultiTurn.step(problem, history)`` may hold none, because an
episode can continue on another worker. ``GameEnv`` bridges the two: it keeps the live game
of each episode in the step process, found by the episode's history, and when it is not
there (the first turn, another process, a restarted one) starts the game again from the
problem and replays the model's earlier turns, checking that the game answers them as it
did before (a game that does not is not deterministic from its problem, and its episode
fails with that reason). A subclass says how a problem's game starts (``new_game``) and
which problems there are (``problems``).

A game's rewards are mapped to the episode's [0, 1]: ``reward_range`` (the game's lowest and
highest reward) maps linearly; ``episode_reward`` says which rewards count, the last one
(``"last"``: an outcome reward) or their sum (``"sum"``: per-turn rewards); the episode is
correct when its mapped reward reaches ``correct_at``.

Steps of different episodes run at once on the step process's threads; an adapter whose
library keeps global state (TextArena seeds the global ``random``) sets ``serial`` and its
steps run one at a time.

With a chat model (``render_prompts``, called by the run with the model's chat template)
a problem's prompt is the first observation rendered as a user message, and each later
observation is a user message too (``EnvStep.role``); without one they are appended as text.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from sluice.envs.base import Draft, Problem, RewardResult, Split, draw_problems
from sluice.envs.multi_turn import EnvStep

LIVE_GAMES = 4096
"""Games kept alive in one step process; an older one is replayed if its episode goes on."""

SEED = "seed"
"""A problem field: the seed a seeded game starts from."""
CHAT = "chat"
"""A problem field: the prompt was rendered with the model's chat template."""

EpisodeReward = Literal["last", "sum"]
Renderer = Callable[[list[dict[str, str]]], str]


@dataclass(frozen=True)
class Turn:
    """A game's answer to one action: what the player sees next, the reward of the action
    (in the game's own range), and whether the game is over."""

    observation: str
    reward: float = 0.0
    done: bool = False
    role: str = "user"
    """With a chat model, the observation is a message of this role."""


class Game(Protocol):
    """One running game, from one problem."""

    def start(self) -> Any:
        """Start the game; its first observation (text, or what the adapter makes a
        prompt of)."""
        ...

    def act(self, action: str) -> Turn:
        """The model's turn ``action``; the game's answer."""
        ...

    def close(self) -> None: ...


class GameError(RuntimeError):
    """A game that cannot go on as the episode says (not deterministic, or broken)."""


@dataclass
class _Live:
    game: Game
    rewards: list[float]


class GameEnv(ABC):
    """A multi-turn environment whose episodes are games (see the module's docstring)."""

    multi_turn = True
    serial = False  # the library keeps global state: one step at a time

    def __init__(
        self,
        name: str,
        reward_range: Sequence[float] = (0.0, 1.0),
        episode_reward: EpisodeReward = "last",
        correct_at: float = 1.0,
    ) -> None:
        low, high = (float(x) for x in reward_range)
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(
                f"reward_range must be [low, high] with low < high, got {reward_range}"
            )
        if episode_reward not in ("last", "sum"):
            raise ValueError(f"episode_reward must be 'last' or 'sum', got {episode_reward!r}")
        self.name = name
        self.low, self.high = low, high
        self.episode_reward = episode_reward
        self.correct_at = float(correct_at)
        self._render: Renderer | None = None
        self._process_state()

    def _process_state(self) -> None:
        """The live games and their locks: this process's own, so a copy sent to another
        process (a rollout worker, a step process) starts with none."""
        self._live: OrderedDict[str, _Live] = OrderedDict()
        self._lock = threading.Lock()  # the live games
        self._serial = threading.Lock() if self.serial else contextlib.nullcontext()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_live", "_lock", "_serial")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._process_state()

    # What a subclass provides.

    @abstractmethod
    def new_game(self, problem: Problem) -> Game:
        """A fresh game of ``problem``, not yet started."""

    @abstractmethod
    def problems(self, split: Split, n: int, seed: int) -> list[Problem]: ...

    def seeded_problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """Problems that are games started from a seed of their own (``fields["seed"]``),
        which decides the split; the prompt is the game's first observation."""

        def draft(rng: random.Random) -> Draft:
            game_seed = rng.randrange(2**31)
            return Draft(str(game_seed), "", "", {SEED: game_seed})

        out = []
        for problem in draw_problems(self.name, split, n, seed, draft):
            with self._serial:
                game = self.new_game(problem)
                first = game.start()
                game.close()
            prompt, fields = self.prompt(first)
            out.append(replace(problem, prompt=prompt, fields={**problem.fields, **fields}))
        return out

    # The run's side.

    def render_prompts(self, render: Renderer | None) -> None:
        """Render prompts with a chat template from now on (None: as plain text)."""
        self._render = render

    def prompt(self, first_observation: str) -> tuple[str, dict[str, Any]]:
        """A problem's prompt text and the fields that say how it was made."""
        if self._render is None:
            return first_observation, {}
        return self._render([{"role": "user", "content": first_observation}]), {CHAT: True}

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """Episodes are scored as they end (``step``); a whole text cannot be."""
        return RewardResult(0.0, False, error=f"{self.name}: scored by its episodes' steps")

    def step(self, problem: Problem, history: list[str]) -> EnvStep:
        with self._lock:
            live = self._live.pop(_key(problem, history[:-1]), None)
        with self._serial:
            live = live or self._replay(problem, history[:-1])
            turn = live.game.act(history[-1])
            live.rewards.append(float(turn.reward))
            if turn.done:
                live.game.close()
                return self._verdict(live.rewards)
        shown = _shown(problem, turn.observation)
        key = _key(problem, [*history, shown])
        with self._lock:
            old = self._live.pop(key, None)  # another sample played the same turns
            self._live[key] = live
            dropped = [
                self._live.popitem(last=False)[1] for _ in range(len(self._live) - LIVE_GAMES)
            ]
        for gone in [*([old] if old else []), *dropped]:
            gone.game.close()
        return EnvStep(shown, role=turn.role if problem.fields.get(CHAT) else None)

    def _replay(self, problem: Problem, history: Sequence[str]) -> _Live:
        """The game at the end of ``history``, started again and replayed."""
        game = self.new_game(problem)
        game.start()
        live = _Live(game, [])
        for action, seen in zip(history[0::2], history[1::2], strict=True):
            turn = game.act(action)
            live.rewards.append(float(turn.reward))
            if turn.done or _shown(problem, turn.observation) != seen:
                game.close()
                raise GameError(
                    f"{self.name}: replayed from its problem, the game answered a turn "
                    "differently than before; it must be deterministic given its problem"
                )
        return live

    def _verdict(self, rewards: list[float]) -> EnvStep:
        raw = rewards[-1] if self.episode_reward == "last" else sum(rewards)
        mapped = (raw - self.low) / (self.high - self.low)
        if not (math.isfinite(mapped) and -1e-9 <= mapped <= 1 + 1e-9):
            raise GameError(
                f"{self.name}: the episode's reward {raw!r} is outside reward_range "
                f"[{self.low:g}, {self.high:g}]; set env.args.reward_range to the game's"
            )
        mapped = min(1.0, max(0.0, mapped))
        return EnvStep(done=True, reward=mapped, correct=mapped >= self.correct_at)


def _shown(problem: Problem, observation: str) -> str:
    """An observation as the episode holds it: a chat message's content, or text set off
    from the model's turn by a newline."""
    return observation if problem.fields.get(CHAT) else "\n" + observation.lstrip("\n")


def _key(problem: Problem, history: Sequence[str]) -> str:
    """An episode's place: its problem and every turn so far."""
    text = json.dumps([problem.prompt_id, problem.prompt, *history])
    return hashlib.sha256(text.encode()).hexdigest()
