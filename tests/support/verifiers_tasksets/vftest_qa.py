"""A single-turn verifiers taskset written with verifiers' API: sums to answer, scored by a
rubric (a reward and a metric). Its id is its module's name, ``vftest_qa``: verifiers
imports a taskset by id, so this folder is on the path of the processes that load it."""

from __future__ import annotations

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(self.data.answer in (trace.last_reply or ""))

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self) -> list[SumTask]:
        return [
            SumTask(
                SumData(prompt=f"What is {a}+{a + 3}?", answer=str(2 * a + 3)), self.config.task
            )
            for a in range(10, 40)
        ]


__all__ = ["SumTaskset"]
