"""Built-in reward functions, named by import path like a user's own (``reward:`` in the
config) and run in the same isolated pool (``envs/rewards.py``).

``reward: sluice.envs.verifiers:math_answer`` scores a math answer against the reference;
several combine with weights, e.g. a right answer plus a small format bonus and a penalty
for responses that run into the length limit::

    reward:
      - sluice.envs.verifiers:math_answer
      - {fn: sluice.envs.verifiers:format_reward, weight: 0.1, args: {pattern: '\\\\boxed\\{'}}
      - {fn: sluice.envs.verifiers:overlong_penalty, args: {max_tokens: 512, buffer: 64}}

Each is also a plain function a user's own reward may call.
"""

from __future__ import annotations

import re
import string
from typing import Any

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is the answer."""
    return float(completion.strip() == str(answer).strip())


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD's answer rule)."""
    words = str(text).casefold().translate(_PUNCTUATION).split()
    return " ".join(w for w in words if w not in ("a", "an", "the"))


def normalized_match(completion: str, answer: str) -> float:
    """1.0 when the completion and the answer are equal after ``normalize``."""
    return float(normalize(completion) == normalize(answer))


def format_reward(completion: str, pattern: str) -> float:
    """1.0 when the regular expression ``pattern`` matches somewhere in the completion."""
    return float(re.search(pattern, completion) is not None)


def overlong_penalty(completion_tokens: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment (Yu et al., arXiv 2503.14476, eq. 13): 0 up to
    ``max_tokens - buffer`` tokens, falling linearly to -1 at ``max_tokens`` and beyond."""
    start = max_tokens - buffer
    if completion_tokens <= start:
        return 0.0
    return -min(1.0, (completion_tokens - start) / max(buffer, 1))


def math_answer(completion: str, answer: str) -> dict[str, Any]:
    """1.0 when ``math-verify`` finds the completion's final answer equal to the reference:
    ``\\boxed{\\frac{1}{2}}`` against ``0.5`` is right, and so are other equivalent forms."""
    from math_verify import parse, verify

    gold, given = parse(str(answer)), parse(completion)
    right = bool(gold) and bool(given) and bool(verify(gold, given))
    return {"reward": float(right), "correct": right, "parsed": float(bool(given))}


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(completion: str, answer: str) -> dict[str, Any]:
    """1.0 when the last number in the completion equals the reference answer (a number):
    "23 + 45 = 68" is right for 68, and so is "68". Stricter than ``math_answer`` for
    arithmetic: math-verify evaluates an expression, so a reply that only restates the
    question ("23 + 45") would count as right, and a policy learns to do just that."""
    found = _NUMBER.findall(completion)
    if not found:
        return {"reward": 0.0, "correct": False, "parsed": 0.0}
    try:
        right = float(found[-1].replace(",", "")) == float(str(answer).replace(",", ""))
    except ValueError:  # "1,2,3" is not one number
        right = False
    return {"reward": float(right), "correct": right, "parsed": 1.0}


def addition(prompt: str, completion: str) -> dict[str, Any]:
    """The built-in addition environment's verifier as a reward function (for a data file
    of addition problems: it reads the operands from the prompt)."""
    from sluice.envs.addition import parse_prompt, plain_reward, scratch_reward

    a, b, scratch = parse_prompt(prompt)
    text = completion.strip()
    result = scratch_reward(a, b, text) if scratch else plain_reward(a, b, text)
    return {"reward": result.reward, "correct": result.correct}
