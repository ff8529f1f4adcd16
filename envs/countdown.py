"""Countdown-style numbers game: combine given numbers with ``+``, ``-``, ``*`` to hit a target.

Generation: ``count`` numbers, each uniform in ``1..max_number`` (with ``long_tail > 0`` the
count per problem is ``count`` plus a heavy-tailed extra in ``0..round(5 * long_tail)``, mostly
0; see ``envs.base.heavy_tail_extra``). A random expression tree over all the numbers (random
order, shape and operators) is rendered with minimal parentheses; its value is the target, so
a solution always exists. Draws with a negative target, or whose reference breaks the parser
limits below, are redrawn.

Prompt: the numbers in ascending order separated by single spaces, ``">"``, the target, ``":"``.
Example: prompt ``"3 5 7>22:"``, reference answer ``"3*5+7"``; ``"7+5*3"`` and ``"(3*5)+7"`` are
equally right, while ``"3*7+1"`` (1 is not given) and ``"5*5-3"`` (5 used twice) score 0.

Answer grammar (the whole completion, stripped of surrounding whitespace)::

    expr   := term (("+" | "-") term)*
    term   := factor ("*" factor)*
    factor := NUMBER | "(" expr ")"

``NUMBER`` is a non-negative decimal integer in ASCII digits without leading zeros. Spaces
between tokens are allowed; nothing else is (no unary minus, no ``=``, no other characters).
``*`` binds tighter than ``+``/``-``; all operators are left-associative. Limits: at most
``MAX_EXPRESSION_CHARS`` characters, at most ``MAX_DEPTH`` nested parentheses, and every
literal and intermediate value must have absolute value at most ``MAX_ABS_VALUE``.

Reward: 1.0 (correct) if the completion parses, each number in it is one of the given numbers
with each given number used at most once (a multiset check; not every number has to be used),
and its value equals the target; otherwise 0.0. The verifier evaluates the expression with its
own parser and never compares strings, so any valid expression is accepted.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import TypeAlias

from sluice.envs.base import (
    DIGITS,
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

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 20
MAX_ABS_VALUE = 10**12
LONG_TAIL_NUMBERS = 5
"""With ``long_tail > 0`` a problem gets up to ``round(LONG_TAIL_NUMBERS * long_tail)`` extra
numbers."""
MAX_SAMPLE_ATTEMPTS = 1000
TARGET_SEPARATOR = ">"
TERMINATOR = ":"
OPERATORS = ("+", "-", "*")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}

Node: TypeAlias = "int | tuple[str, Node, Node]"
"""An expression tree: a number, or ``(operator, left, right)``."""


class ExpressionError(ValueError):
    """A completion is not a valid expression under the grammar and limits."""


@dataclass(frozen=True)
class Evaluation:
    """A parsed expression's value and the numbers it used, in order of appearance."""

    value: int
    numbers: tuple[int, ...]


def tokenize(text: str) -> list[str]:
    """Split ``text`` into number, operator and parenthesis tokens, skipping spaces."""
    tokens: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char == " ":
            i += 1
        elif char in "+-*()":
            tokens.append(char)
            i += 1
        elif char in DIGITS:
            start = i
            while i < len(text) and text[i] in DIGITS:
                i += 1
            tokens.append(text[start:i])
        else:
            raise ExpressionError(f"unexpected character {char!r} at {i}")
    return tokens


def _bounded(value: int) -> int:
    """Return ``value``, or raise ``ExpressionError`` if its magnitude is over the limit."""
    if abs(value) > MAX_ABS_VALUE:
        raise ExpressionError(f"value out of range (|value| > {MAX_ABS_VALUE})")
    return value


class _Parser:
    """Recursive-descent parser and evaluator over a token list."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.numbers: list[int] = []

    def _peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ExpressionError("unexpected end of expression")
        self.pos += 1
        return token

    def parse(self) -> Evaluation:
        if not self.tokens:
            raise ExpressionError("empty expression")
        value = self._expr()
        if self.pos != len(self.tokens):
            raise ExpressionError(f"unexpected token {self.tokens[self.pos]!r}")
        return Evaluation(value=value, numbers=tuple(self.numbers))

    def _expr(self) -> int:
        value = self._term()
        while self._peek() in ("+", "-"):
            operator = self._take()
            right = self._term()
            value = _bounded(value + right if operator == "+" else value - right)
        return value

    def _term(self) -> int:
        value = self._factor()
        while self._peek() == "*":
            self._take()
            value = _bounded(value * self._factor())
        return value

    def _factor(self) -> int:
        token = self._take()
        if token == "(":
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise ExpressionError(f"parentheses nested deeper than {MAX_DEPTH}")
            value = self._expr()
            if self._take() != ")":
                raise ExpressionError("expected ')'")
            self.depth -= 1
            return value
        number = parse_nonneg_int(token, max_digits=len(str(MAX_ABS_VALUE)))
        if number is None:
            raise ExpressionError(f"unexpected token {token[:20]!r}")
        self.numbers.append(_bounded(number))
        return number


def evaluate(text: str) -> Evaluation:
    """Parse and evaluate ``text`` (already stripped); raise ``ExpressionError`` if invalid."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    return _Parser(tokenize(text)).parse()


def random_tree(rng: random.Random, numbers: list[int]) -> Node:
    """Return a random expression tree using each of ``numbers`` once, in the given order."""
    if len(numbers) == 1:
        return numbers[0]
    split = rng.randint(1, len(numbers) - 1)
    operator = rng.choice(OPERATORS)
    return (operator, random_tree(rng, numbers[:split]), random_tree(rng, numbers[split:]))


def render(node: Node) -> str:
    """Render ``node`` as text with only the parentheses the grammar needs."""
    if isinstance(node, int):
        return str(node)
    operator, left, right = node
    return (
        f"{_render_child(left, operator, is_right=False)}{operator}"
        f"{_render_child(right, operator, is_right=True)}"
    )


def _render_child(child: Node, parent: str, is_right: bool) -> str:
    text = render(child)
    if isinstance(child, int):
        return text
    child_precedence, parent_precedence = _PRECEDENCE[child[0]], _PRECEDENCE[parent]
    needs_parens = child_precedence < parent_precedence or (
        is_right and parent == "-" and child_precedence == parent_precedence
    )
    return f"({text})" if needs_parens else text


def format_prompt(numbers: list[int], target: int) -> str:
    """Return the prompt for ``numbers`` (sorted in the prompt) and ``target``."""
    listed = " ".join(str(number) for number in sorted(numbers))
    return f"{listed}{TARGET_SEPARATOR}{target}{TERMINATOR}"


def parse_prompt(prompt: str) -> tuple[list[int], int]:
    """Return ``(numbers, target)`` from a countdown prompt; raise ``ValueError`` if not one."""
    body, sep, target_text = prompt.removesuffix(TERMINATOR).partition(TARGET_SEPARATOR)
    numbers = [parse_nonneg_int(part, max_digits=len(prompt)) for part in body.split(" ")]
    target = parse_nonneg_int(target_text, max_digits=len(prompt))
    if not prompt.endswith(TERMINATOR) or not sep or target is None or None in numbers:
        raise ValueError(f"not a countdown prompt: {prompt[:80]!r}")
    return [number for number in numbers if number is not None], target


def uses_allowed_numbers(used: tuple[int, ...], given: list[int]) -> bool:
    """Whether ``used`` is a sub-multiset of ``given`` (each given number used at most once)."""
    return Counter(used) <= Counter(given)


class CountdownEnv:
    """Countdown numbers game; see the module docstring for formats and rewards."""

    name: str = "countdown"

    def __init__(self, count: int = 3, max_number: int = 10, long_tail: float = 0.0) -> None:
        self.count = check_positive_int("count", count)
        self.max_number = check_positive_int("max_number", max_number)
        if self.max_number > MAX_ABS_VALUE:
            raise ValueError(f"max_number must be at most {MAX_ABS_VALUE}, got {max_number}")
        self.long_tail = check_long_tail(long_tail)
        self.max_extra_numbers = round(LONG_TAIL_NUMBERS * self.long_tail)

    def _sample(self, rng: random.Random) -> Draft:
        for _ in range(MAX_SAMPLE_ATTEMPTS):
            size = self.count + heavy_tail_extra(rng, self.long_tail, self.max_extra_numbers)
            numbers = [rng.randint(1, self.max_number) for _ in range(size)]
            answer = render(random_tree(rng, numbers))
            try:
                target = evaluate(answer).value
            except ExpressionError:
                continue
            if target >= 0:
                ordered = sorted(numbers)
                canonical = f"{' '.join(map(str, ordered))}{TARGET_SEPARATOR}{target}"
                return Draft(canonical, format_prompt(numbers, target), answer)
        raise ValueError(
            f"countdown: no valid problem in {MAX_SAMPLE_ATTEMPTS} attempts; the settings "
            f"(count={self.count}, max_number={self.max_number}, long_tail={self.long_tail}) "
            f"make reference expressions exceed the parser limits"
        )

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """Return ``n`` problems of ``split`` drawn deterministically from ``seed``."""
        return draw_problems(self.name, split, n, seed, self._sample)

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        """Score ``completion`` by evaluating it; any valid expression hitting the target wins."""
        if problem.env != self.name:
            raise ValueError(f"problem {problem.prompt_id!r} is from env {problem.env!r}")
        numbers, target = parse_prompt(problem.prompt)
        try:
            evaluation = evaluate(completion.strip())
        except ExpressionError:
            return RewardResult(reward=0.0, correct=False)
        if evaluation.value == target and uses_allowed_numbers(evaluation.numbers, numbers):
            return RewardResult(reward=1.0, correct=True)
        return RewardResult(reward=0.0, correct=False)
