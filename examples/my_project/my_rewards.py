"""A user's reward functions: plain Python, named in the config by import path
(``reward: my_rewards:final_sum`` with this folder on PYTHONPATH).

Sluice calls each in a separate process with a time and memory limit, passing the prompt,
the completion and the row's fields by name; a function takes only the names it declares.
"""

from __future__ import annotations

import re


def final_sum(prompt: str, completion: str) -> dict:
    """1.0 when the number after the last '|' is the sum the prompt asks for."""
    a, b = (int(x) for x in prompt.rstrip("?=").split("+"))
    given = completion.strip().rpartition("|")[2].strip()
    right = given == str(a + b)
    return {"reward": float(right), "correct": right, "answered": float("|" in completion)}


def shows_work(completion: str) -> float:
    """A small bonus for writing column work before the sum (a format reward)."""
    work, bar, _ = completion.partition("|")
    return float(bool(bar) and "=" in work)


def sum_in_reply(completion: str, answer: str, digits: int) -> dict:
    """For chat.yaml: 1.0 when the last number in the reply is the sum. ``digits`` is a column
    of the data file, passed on because chat.yaml lists it in ``data.fields``; it is logged
    per sample beside the reward."""
    numbers = re.findall(r"-?\d+", completion)
    right = bool(numbers) and numbers[-1] == answer
    return {"reward": float(right), "correct": right, "digits": float(digits)}
