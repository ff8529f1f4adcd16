"""A user's reward functions: plain Python, named in the config by import path
(``reward: my_rewards:final_sum`` with this folder on PYTHONPATH).

Sluice calls each in a separate process with a time and memory limit, passing the prompt,
the completion and the row's fields by name; a function takes only the names it declares.
"""

from __future__ import annotations


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
