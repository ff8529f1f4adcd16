"""The staleness rule: how old a group of samples is, and when it is too old to train.

One rule for the trajectory store (``storage/trajectory_index.py``, which drops what it
says is too stale before each lease) and the simulator (``sim/engine.py``), so what the
simulator predicts at scale is what a run does. Groups are trained whole (their
advantages are relative to each other), so the rule dates groups, not samples.

With partial rollout a worker loads new weights while its samples run, so the tokens of
a group come from a range of versions: its first token's and its last token's. A group's
short samples finish under the version that started them; its longest finishes last.

- ``last_token`` (the default): a group is as old as its last token, the newest.
  ``max_staleness`` then bounds how far the trainer has moved on since the group was
  finished; admission (``engines/rollout/dispatcher.py``) still bounds how far ahead of training
  a group may start. Its earlier tokens may be older: every token carries the
  log-probability its own policy gave it (``behaviour_logprobs``), so the loss's ratio is
  per token against the policy that really sampled it (PPO's ratio; AReaL's decoupled
  objective, arXiv 2505.24298 section 5.2, made for the mixed-version trajectories of its
  interruptible generation), and the clip or ``train.is_cap`` bounds what an old token
  contributes. The long tail is trained, not thrown away.
- ``first_token``: a group is as old as its first token, the oldest. Every token is then
  within the bound, but a group whose generation spans more than ``max_staleness``
  versions is dropped however fresh it is when it finishes: at scale that is most groups
  with a long sample (a bias towards short answers, and generation paid for and
  discarded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

StaleBy = Literal["last_token", "first_token"]


def group_version(spans: Iterable[tuple[int, int]], by: StaleBy) -> int:
    """The version a group counts as; each of its samples is a (first, last) token version."""
    firsts, lasts = zip(*spans, strict=True)
    return max(lasts) if by == "last_token" else min(firsts)


def too_stale(current_version: int, version: int, max_staleness: int) -> bool:
    """Whether a group of ``version`` may no longer train the policy at ``current_version``."""
    return current_version - version > max_staleness
