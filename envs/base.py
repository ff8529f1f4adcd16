"""Shared types and helpers for Sluice's verifiable environments.

An *environment* generates problems (a prompt for the model plus one reference answer) and
scores a model completion against a problem. Completions are untrusted text: verifiers parse
them with small hand-written parsers and never evaluate them as code.

Splits: every problem has a *canonical content* string (for example ``"47+385"``). Whether a
problem is ``"train"`` or ``"heldout"`` is decided by a SHA-256 hash of the environment name and
that canonical content (about 1 in ``HELDOUT_MODULUS`` problems is held out), so the same problem
always lands in the same split whatever seed drew it, and the two splits never overlap.

Prompt ids have the form ``f"{env}/{split}/{seed}/{index}"``: unique within one call of
``problems`` and stable for a given ``(split, seed, index)``. Asking for more problems with the
same seed extends the list: ``problems(split, n, seed)`` is a prefix of
``problems(split, n + k, seed)``.

``score`` wraps an environment's ``reward`` so that it never raises: a verifier exception or an
invalid reward becomes reward 0.0 with ``error`` set, and is logged as a warning.

``ALPHABET`` is every character a prompt or answer may contain: printable ASCII 32..126, so that
a character-level tokenizer built from it can represent any model output.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

# A built-in verifier parses a short answer in microseconds; one still running after this
# long is stuck (model output can be adversarial), and its sample fails instead of the
# rollout worker stalling.
VERIFIER_TIMEOUT_S = 1.0

ALPHABET: str = "".join(chr(code) for code in range(32, 127))
"""Every character any prompt or answer may contain: printable ASCII 32..126."""

Split = Literal["train", "heldout"]
SPLITS: tuple[Split, ...] = ("train", "heldout")
HELDOUT_MODULUS = 10
"""A problem is held out when its content hash is divisible by this (about 10%)."""

TAIL_SHAPE = 1.5
"""Pareto shape at ``long_tail == 1``; the shape used is ``TAIL_SHAPE / long_tail``."""

DIGITS = frozenset("0123456789")
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Problem:
    """One generated problem."""

    prompt_id: str
    """Stable, unique within a call: ``f"{env}/{split}/{seed}/{index}"``."""
    env: str
    """Environment name."""
    prompt: str
    """Exact text fed to the model; ends with a terminator so the model knows to answer."""
    answer: str
    """One reference completion (for supervised warm start); does not include the prompt."""
    split: str
    """``"train"`` or ``"heldout"``."""
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """Further data of the problem that reaches a user's reward function (a dataset row's
    mapped columns); ``answer`` is passed to it as well."""


@dataclass(frozen=True)
class RewardResult:
    """The verdict on one completion."""

    reward: float
    """In [0, 1] from a built-in verifier; any finite number from a user's reward."""
    correct: bool
    """Fully right (what accuracy counts)."""
    error: str | None = None
    """Set when the verifier raised or returned something invalid: the sample failed."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """Each user reward function's own reward and extra metrics, by name."""
    verdict: str | None = None
    """What a judge model answered about the completion (kept in the row and the ledger)."""


class Environment(Protocol):
    """What every environment provides."""

    name: str

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """Return ``n`` problems of ``split``, deterministically from ``seed``."""
        ...

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """Score ``completion`` (the model's whole output, prompt excluded) for ``problem``."""
        ...


@runtime_checkable
class ChatPrompts(Protocol):
    """An environment whose prompts are chat messages: the run hands it the model folder's
    chat template (``render``: messages -> the prompt text; None: the folder has none)."""

    def render_prompts(self, render: Callable[[list[dict[str, Any]]], str] | None) -> None: ...


@dataclass(frozen=True)
class Draft:
    """A sampled problem before its split is known."""

    canonical: str
    """Canonical content; decides the split and identifies the problem for dedupe."""
    prompt: str
    answer: str
    fields: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The problem's ``fields``."""


def split_of(env_name: str, canonical: str) -> Split:
    """Return the split a problem belongs to, from a stable hash of its canonical content."""
    digest = hashlib.sha256(f"{env_name}:{canonical}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") % HELDOUT_MODULUS == 0 else "train"


def check_split(split: str) -> Split:
    """Return ``split`` if it is a known split, else raise ``ValueError``."""
    for known in SPLITS:
        if split == known:
            return known
    raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")


def max_draws(n: int) -> int:
    """How many samples ``draw_problems`` may take before deciding the space is too small."""
    return 1000 + 200 * n


def draw_problems(
    env_name: str, split: str, n: int, seed: int, sample: Callable[[random.Random], Draft]
) -> list[Problem]:
    """Sample until there are ``n`` problems of ``split``; held-out problems are unique.

    Raises ``ValueError`` for a bad split or ``n``, and when the problem space is too small to
    supply ``n`` problems of the split within ``max_draws(n)`` samples.
    """
    checked = check_split(split)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Problem] = []
    budget = max_draws(n)
    draws = 0
    while len(out) < n:
        if draws >= budget:
            raise ValueError(
                f"{env_name}: problem space too small: found only {len(out)} of {n} {checked} "
                f"problems in {budget} draws; widen the environment's settings or ask for fewer"
            )
        draws += 1
        draft = sample(rng)
        if split_of(env_name, draft.canonical) != checked:
            continue
        if checked == "heldout":
            if draft.canonical in seen:
                continue
            seen.add(draft.canonical)
        out.append(
            Problem(
                prompt_id=f"{env_name}/{checked}/{seed}/{len(out)}",
                env=env_name,
                prompt=draft.prompt,
                answer=draft.answer,
                split=checked,
                fields=draft.fields,
            )
        )
    return out


def check_long_tail(long_tail: float) -> float:
    """Return ``long_tail`` as a float if it is finite and >= 0, else raise ``ValueError``."""
    if isinstance(long_tail, bool) or not isinstance(long_tail, int | float):
        raise ValueError(f"long_tail must be a number >= 0, got {long_tail!r}")
    value = float(long_tail)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"long_tail must be finite and >= 0, got {long_tail!r}")
    return value


def check_positive_int(name: str, value: int) -> int:
    """Return ``value`` if it is an int >= 1, else raise ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def heavy_tail_extra(rng: random.Random, long_tail: float, max_extra: int) -> int:
    """Draw a heavy-tailed non-negative extra size in ``[0, max_extra]``; mostly 0.

    Draws ``k = floor(U ** (-1 / alpha))`` (a discretised Pareto, ``P(k >= m) = m ** -alpha``)
    with ``alpha = TAIL_SHAPE / long_tail`` and returns ``min(k - 1, max_extra)``. With
    ``long_tail == 0`` or ``max_extra <= 0`` it returns 0 without consuming randomness.
    """
    if long_tail <= 0 or max_extra <= 0:
        return 0
    alpha = TAIL_SHAPE / long_tail
    log_k = -math.log(1.0 - rng.random()) / alpha  # 1 - random() is in (0, 1]
    if log_k >= math.log(max_extra + 1):
        return max_extra
    return min(max_extra, int(math.exp(log_k)) - 1)


def parse_nonneg_int(text: str, max_digits: int = 64) -> int | None:
    """Parse a canonical non-negative decimal integer; return ``None`` if malformed.

    Accepts only ASCII digits, no sign, no leading zeros (except ``"0"``), no whitespace and
    at most ``max_digits`` digits. Unlike ``int()`` it rejects ``"1_000"``, ``" 7"``, ``"+7"``
    and non-ASCII digits such as ``"٤"``.
    """
    if not text or len(text) > max_digits:
        return None
    if any(char not in DIGITS for char in text):
        return None
    if len(text) > 1 and text[0] == "0":
        return None
    return int(text)


def _one_line(text: str) -> str:
    """Collapse ``text`` to a single line of bounded length."""
    flat = " ".join(text.split())
    if len(flat) > _MAX_ERROR_CHARS:
        return flat[: _MAX_ERROR_CHARS - 3] + "..."
    return flat


def _describe_exception(exc: Exception) -> str:
    """Describe an exception without trusting its ``__str__``."""
    try:
        detail = str(exc)
    except Exception:
        detail = "<unprintable>"
    return f"verifier raised {type(exc).__name__}: {detail}"


def _invalid_reason(result: object) -> str | None:
    """Return why ``result`` is not a valid ``RewardResult``, or ``None`` if it is valid."""
    if not isinstance(result, RewardResult):
        return f"verifier returned {type(result).__name__}, not RewardResult"
    reward = result.reward
    if not isinstance(reward, float):
        return f"reward is {type(reward).__name__}, not float"
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        return f"reward {reward!r} is outside [0, 1]"
    if not isinstance(result.correct, bool):
        return f"correct is {type(result.correct).__name__}, not bool"
    if result.error is not None and not isinstance(result.error, str):
        return f"error is {type(result.error).__name__}, not str or None"
    return None


def _failure(env: object, problem: object, detail: str) -> RewardResult:
    """Build (and log) the zero reward that stands in for a failed verification."""
    env_name = getattr(env, "name", None)
    if not isinstance(env_name, str):
        env_name = type(env).__name__
    prompt_id = getattr(problem, "prompt_id", None)
    message = _one_line(f"env={env_name} prompt_id={prompt_id}: {detail}")
    logger.warning("reward verification failed: %s", message)
    return RewardResult(reward=0.0, correct=False, error=message)


class VerifierTimeout(Exception):
    """A verifier ran past its time budget."""


@contextmanager
def _time_budget(seconds: float) -> Iterator[None]:
    """Raise ``VerifierTimeout`` in this thread after ``seconds`` of wall time.

    A timer signal interrupts Python code wherever it loops; signals reach only the main
    thread, which is where a rollout worker (a Ray actor) and the tests run verifiers. In
    any other thread the verifier runs without a budget.
    """
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise VerifierTimeout(f"the verifier ran past its {seconds:g} s time budget")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def score(
    env: Environment, problem: Problem, completion: str, timeout_s: float = VERIFIER_TIMEOUT_S
) -> RewardResult:
    """Score ``completion`` with ``env.reward``; never raises.

    A verifier exception, a verifier that runs past ``timeout_s``, or a result that is not a
    ``RewardResult`` with a float reward in [0, 1] (NaN and infinities are rejected) and a
    bool ``correct``, becomes reward 0.0, ``correct=False`` and ``error`` set to a one-line
    description naming the environment and the prompt id; the failure is logged with
    ``logging.getLogger(__name__).warning``.
    """
    try:
        with _time_budget(timeout_s):
            result = env.reward(problem, completion)
    except VerifierTimeout as exc:
        return _failure(env, problem, str(exc))
    except Exception as exc:
        return _failure(env, problem, _describe_exception(exc))
    reason = _invalid_reason(result)
    if reason is not None:
        return _failure(env, problem, reason)
    return result
