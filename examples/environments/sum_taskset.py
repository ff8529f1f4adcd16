"""A verifiers taskset of a user's own (verifiers 0.4's ``verifiers.v1`` API): 2-digit sums,
scored by a rubric that reads the reply's last number. verifiers loads a taskset by its id,
importing the module of that name: ``taskset: sum-taskset`` imports ``sum_taskset`` (this
file, on ``PYTHONPATH``). It needs nothing from Sluice."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

NUMBER = re.compile(r"-?\d+")


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def last_number_is_the_sum(self, trace: vf.Trace) -> float:
        found = NUMBER.findall(trace.last_reply or "")
        return float(bool(found) and found[-1] == self.data.answer)


class SumTaskset(vf.Taskset[SumTask]):
    def load(self) -> list[SumTask]:
        rng, tasks = random.Random(0), []
        for _ in range(3000):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            prompt = f"What is {a}+{b}? Answer with just the number."
            tasks.append(SumTask(SumData(prompt=prompt, answer=str(a + b)), self.config.task))
        return tasks


__all__ = ["SumTaskset"]
