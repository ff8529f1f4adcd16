"""TextArena games as multi-turn environments (``env.name: textarena``; the ``textarena``
package, ``pip install 'sluice[envs]'``).

    env:
      name: textarena
      args: {game: GuessTheNumber-v0}           # any registered game id
      max_turns: 10

A problem is one game, started with its own seed (the seed decides the split, so a held-out
game is never trained on); its prompt is the game's opening observation. Each model turn is
the player's action; the next observation is what the game said since (its messages, the
opponent's moves), one line each. The episode ends with the game: the player's reward mapped to
[0, 1] from TextArena's range (single-player games: 0 to 1, a win 1 and a game given up
its share done; two-player games: -1 loss, 0 draw, 1 win); a reward of 1 is correct.

The game is built without TextArena's observation wrappers (its ``-raw`` version): those
repeat the whole game so far in every observation, where an episode here already holds it.

Two-player games play against a fixed opponent: ``opponent`` is the import path of a
function ``(observation: str) -> str`` (``player`` says which seat the model takes).
Games run in the environment's step process (``envs/games.py``: the live game is kept,
or started again and replayed when its episode moves).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sluice.envs.base import Problem, Split
from sluice.envs.games import SEED, EpisodeReward, GameEnv, Turn
from sluice.envs.rewards import import_function

RAW = "-raw"


def _textarena() -> Any:
    try:
        import textarena
    except ImportError as error:
        raise ValueError(
            f"the textarena environment needs the textarena package ({error}); install it "
            "with pip install 'sluice[envs]'"
        ) from None
    return textarena


def _text(messages: Any, player: int) -> str:
    """An observation as text: each message of the game or another player on a line (the
    player's own action, which the episode holds already, left out)."""
    if isinstance(messages, str):
        return messages
    lines = [str(text).strip() for sender, text, *_ in messages if sender != player]
    return "\n".join(line for line in lines if line) + "\n"


class ArenaGame:
    """One TextArena game, the model in seat ``player``."""

    def __init__(
        self,
        game_id: str,
        seed: int,
        players: int,
        player: int,
        opponent: Callable[[str], str] | None,
        game_args: dict[str, Any],
    ) -> None:
        self.env = _textarena().make(env_id=game_id, **game_args)
        self.seed, self.players, self.player, self.opponent = seed, players, player, opponent

    def start(self) -> str:
        self.env.reset(num_players=self.players, seed=self.seed)
        return self._until_mine(done=False).observation

    def act(self, action: str) -> Turn:
        done, _ = self.env.step(action=action)
        return self._until_mine(done)

    def _until_mine(self, done: bool) -> Turn:
        """The opponent plays until it is the model's turn or the game ends."""
        while not done:
            seat, messages = self.env.get_observation()
            if seat == self.player:
                return Turn(_text(messages, self.player))
            if self.opponent is None:
                raise ValueError(f"seat {seat} has no player: set env.args.opponent")
            done, _ = self.env.step(action=str(self.opponent(_text(messages, seat))))
        rewards, _ = self.env.close()
        return Turn("", float(rewards[self.player]), done=True)

    def close(self) -> None:
        pass  # a finished game is closed by ``_until_mine``; an abandoned one holds nothing


class TextArenaEnv(GameEnv):
    """TextArena's ``game``, played from seat ``player`` (see the module's docstring)."""

    import_args = ("opponent",)  # the user's code: its folder reaches the step process
    serial = True  # TextArena seeds and draws from the global random

    def __init__(
        self,
        game: str,
        players: int = 1,
        player: int = 0,
        opponent: str | None = None,
        game_args: dict[str, Any] | None = None,
        reward_range: Sequence[float] | None = None,
        episode_reward: EpisodeReward = "last",
        correct_at: float = 1.0,
    ) -> None:
        if reward_range is None:  # TextArena's: a share of the game done, or loss/draw/win
            reward_range = (0.0, 1.0) if players == 1 else (-1.0, 1.0)
        super().__init__(f"textarena/{game}", reward_range, episode_reward, correct_at)
        registry = _textarena().envs.registration.ENV_REGISTRY
        self.game_id = game if game.endswith(RAW) else game + RAW
        if self.game_id not in registry:
            known = sorted(g for g in registry if not g.endswith(RAW) and "-" in g)
            raise ValueError(f"unknown TextArena game {game!r}; for example {known[:8]}")
        if not 0 <= player < players:
            raise ValueError(f"player must be a seat in 0..{players - 1}, got {player}")
        if players > 1 and opponent is None:
            raise ValueError(f"a {players}-player game needs an opponent (an import path)")
        self.players, self.player = players, player
        self.opponent = import_function(opponent) if opponent else None
        self.game_args = dict(game_args or {})

    def new_game(self, problem: Problem) -> ArenaGame:
        seed = int(problem.fields[SEED])
        return ArenaGame(
            self.game_id, seed, self.players, self.player, self.opponent, self.game_args
        )

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        return self.seeded_problems(split, n, seed)
