"""Multi-digit addition of two non-negative integers.

Operands: each operand independently has ``d`` digits, ``d`` uniform in ``1..digits`` (a
1-digit operand is 0..9, a ``d``-digit operand has no leading zero). With ``long_tail > 0``
each operand also gets a heavy-tailed number of extra digits, ``0..round(8 * long_tail)``
(mostly 0; see ``envs.base.heavy_tail_extra``), so most problems are short and a few are long.

Plain mode (``scratch=False`` and ``long_tail == 0``):

* prompt ``"47+385="``, answer ``"432"``.
* reward 1.0 (correct) if the completion, stripped of surrounding whitespace, is the sum
  written as a canonical decimal integer (ASCII digits only, no sign, no leading zeros, no
  ``_`` or spaces); otherwise 0.0.

Scratch mode (``scratch=True`` or ``long_tail > 0``): the prompt ends with ``"?"`` instead of
``"="`` and the model writes column-by-column work, then ``"|"``, then the sum:

* prompt ``"47+385?"``, answer ``"7+5=12,4+8+1=13,0+3+1=4|432"``.
* columns go from the least significant digit up, one per digit of the longer operand,
  separated by ``","``. A column is ``"{a}+{b}={s}"`` where ``a`` and ``b`` are that column's
  digits (0 past the end of the shorter operand) and ``s`` is their sum plus the incoming
  carry; when the carry is 1 the column is ``"{a}+{b}+1={s}"``. The carry out is ``s // 10``.
  A final carry needs no extra column: it shows up as the leading ``1`` of the sum.
* reward (completion stripped of surrounding whitespace; it must contain exactly one ``"|"``):
  1.0 and correct if the sum after ``"|"`` is right (same canonical-integer rule as plain
  mode) and the work before it is exactly the column work above (it is fully determined by
  the operands). Otherwise partial credit, not correct: 0.5 for a right sum plus 0.5 times
  the fraction of expected columns written exactly right, in place (an extra column costs
  one right column). No delimiter, or more than one, scores 0.0.

The split is decided from the canonical content ``f"{min(a, b)}+{max(a, b)}"`` so that
``47+385`` and ``385+47`` are always in the same split, in both modes.
"""

from __future__ import annotations

import random

from sluice.envs.base import (
    Draft,
    Problem,
    RewardResult,
    Split,
    check_long_tail,
    check_positive_int,
    draw_problems,
    heavy_tail_extra,
    parse_nonneg_int,
)

PLAIN_TERMINATOR = "="
SCRATCH_TERMINATOR = "?"
ANSWER_DELIMITER = "|"
COLUMN_SEPARATOR = ","
WORK_SHARE = 0.5
"""Share of a scratch-mode reward earned by the column work (the rest: the final sum)."""
LONG_TAIL_DIGITS = 8
"""With ``long_tail > 0`` an operand gets up to ``round(LONG_TAIL_DIGITS * long_tail)`` extra
digits."""


def random_operand(rng: random.Random, n_digits: int) -> int:
    """Return a uniformly random integer with exactly ``n_digits`` digits (0..9 for one)."""
    if n_digits == 1:
        return rng.randint(0, 9)
    return rng.randint(10 ** (n_digits - 1), 10**n_digits - 1)


def scratch_work(a: int, b: int) -> str:
    """Return the column-by-column work for ``a + b``, e.g. ``"7+5=12,4+8+1=13,0+3+1=4"``."""
    a_digits, b_digits = str(a)[::-1], str(b)[::-1]
    width = max(len(a_digits), len(b_digits))
    columns: list[str] = []
    carry = 0
    for i in range(width):
        x = int(a_digits[i]) if i < len(a_digits) else 0
        y = int(b_digits[i]) if i < len(b_digits) else 0
        total = x + y + carry
        addends = f"{x}+{y}+1" if carry else f"{x}+{y}"
        columns.append(f"{addends}={total}")
        carry = total // 10
    return COLUMN_SEPARATOR.join(columns)


def scratch_answer(a: int, b: int) -> str:
    """Return the full scratch-mode reference answer for ``a + b``."""
    return f"{scratch_work(a, b)}{ANSWER_DELIMITER}{a + b}"


def parse_prompt(prompt: str) -> tuple[int, int, bool]:
    """Return ``(a, b, scratch)`` from an addition prompt; raise ``ValueError`` if it is not one."""
    if prompt.endswith(PLAIN_TERMINATOR):
        scratch = False
    elif prompt.endswith(SCRATCH_TERMINATOR):
        scratch = True
    else:
        raise ValueError(f"not an addition prompt: {prompt[:80]!r}")
    parts = prompt[:-1].split("+")
    operands = [parse_nonneg_int(part, max_digits=len(prompt)) for part in parts]
    if len(operands) != 2 or operands[0] is None or operands[1] is None:
        raise ValueError(f"not an addition prompt: {prompt[:80]!r}")
    return operands[0], operands[1], scratch


def _is_sum(text: str, expected: int) -> bool:
    """Whether ``text`` is ``expected`` written as a canonical non-negative integer."""
    return parse_nonneg_int(text, max_digits=len(str(expected))) == expected


def plain_reward(a: int, b: int, text: str) -> RewardResult:
    """Score a stripped plain-mode completion."""
    if _is_sum(text, a + b):
        return RewardResult(reward=1.0, correct=True)
    return RewardResult(reward=0.0, correct=False)


def scratch_reward(a: int, b: int, text: str) -> RewardResult:
    """Score a stripped scratch-mode completion: work, delimiter, sum.

    Half the reward is for the sum, half for the work, shared equally by the expected
    columns (column i of the completion earns its share only if it equals expected column
    i exactly). The partial credit gives a learning signal per column fact before whole
    answers come out right; ``correct`` still needs every column and the sum.
    """
    if text.count(ANSWER_DELIMITER) != 1:
        return RewardResult(reward=0.0, correct=False)
    work, final = text.split(ANSWER_DELIMITER)
    expected = scratch_work(a, b)
    sum_ok = _is_sum(final, a + b)
    if work == expected:
        return RewardResult(reward=1.0 if sum_ok else WORK_SHARE, correct=sum_ok)
    wanted = expected.split(COLUMN_SEPARATOR)
    # Bounded split: a flood of separators costs nothing beyond the expected columns.
    given = work.split(COLUMN_SEPARATOR, len(wanted))
    right = sum(g == w for g, w in zip(given, wanted, strict=False))
    if len(given) > len(wanted):
        right = max(right - 1, 0)  # extra columns are wrong work
    credit = WORK_SHARE * right / len(wanted)
    return RewardResult(reward=(1.0 - WORK_SHARE) * sum_ok + credit, correct=False)


class AdditionEnv:
    """Multi-digit addition; see the module docstring for formats and rewards."""

    name: str = "addition"

    def __init__(self, digits: int = 2, long_tail: float = 0.0, scratch: bool = False) -> None:
        self.digits = check_positive_int("digits", digits)
        self.long_tail = check_long_tail(long_tail)
        self.scratch = bool(scratch) or self.long_tail > 0
        self.max_extra_digits = round(LONG_TAIL_DIGITS * self.long_tail)

    def _operand_digits(self, rng: random.Random) -> int:
        base = rng.randint(1, self.digits)
        return base + heavy_tail_extra(rng, self.long_tail, self.max_extra_digits)

    def _sample(self, rng: random.Random) -> Draft:
        a = random_operand(rng, self._operand_digits(rng))
        b = random_operand(rng, self._operand_digits(rng))
        canonical = f"{min(a, b)}+{max(a, b)}"
        if self.scratch:
            return Draft(canonical, f"{a}+{b}{SCRATCH_TERMINATOR}", scratch_answer(a, b))
        return Draft(canonical, f"{a}+{b}{PLAIN_TERMINATOR}", str(a + b))

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """Return ``n`` problems of ``split`` drawn deterministically from ``seed``."""
        return draw_problems(self.name, split, n, seed, self._sample)

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """Score ``completion``; the mode (plain or scratch) is read from the prompt."""
        if problem.env != self.name:
            raise ValueError(f"problem {problem.prompt_id!r} is from env {problem.env!r}")
        a, b, scratch = parse_prompt(problem.prompt)
        text = completion.strip()
        if scratch:
            return scratch_reward(a, b, text)
        return plain_reward(a, b, text)
