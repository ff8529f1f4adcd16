"""reasoning-gym's procedurally generated tasks as environments (``env.name:
reasoning_gym`` with ``env.args: {task: basic_arithmetic}``).

reasoning-gym (``pip install reasoning-gym``, installed with Sluice) generates 100+
verifiable tasks offline from a seed; each entry has a question, an answer and metadata,
and the task's own ``score_answer`` scores an answer in [0, 1]. Here an entry's question is
the prompt, its answer the reference, and the score the reward (correct at 1.0). The
answer is read from ``<answer>...</answer>`` tags when the completion has them, else the
whole completion. Train and held-out entries are split by a hash of the question, as the
built-in environments split theirs.
"""

from __future__ import annotations

import re
from typing import Any

from sluice.envs.base import Problem, RewardResult, Split, check_split, split_of

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymEnv:
    """One reasoning-gym task: ``size`` entries generated from ``seed`` (with the task's
    own ``config`` keywords); the dataset is built in each process that uses it."""

    def __init__(
        self, task: str, size: int = 10000, seed: int = 0, config: dict[str, Any] | None = None
    ) -> None:
        import reasoning_gym

        tasks = reasoning_gym.factory.DATASETS
        if task not in tasks:
            raise ValueError(
                f"reasoning-gym has no task {task!r}; it has {len(tasks)}, e.g. "
                "basic_arithmetic, leg_counting, chain_sum (reasoning_gym.factory.DATASETS)"
            )
        self.task, self.size, self.seed, self.config = task, size, seed, dict(config or {})
        self.name = f"reasoning_gym/{task}"
        self._dataset: Any = None

    @property
    def dataset(self) -> Any:
        if self._dataset is None:
            import reasoning_gym

            self._dataset = reasoning_gym.create_dataset(
                self.task, size=self.size, seed=self.seed, **self.config
            )
        return self._dataset

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_dataset": None}  # rebuilt where it is used

    def problems(self, split: Split, n: int, seed: int) -> list[Problem]:
        """The first ``n`` entries of ``split``, in the dataset's order (``seed`` is not used:
        ``env.args.seed`` generates the entries)."""
        checked = check_split(split)
        out: list[Problem] = []
        for index in range(self.size):
            if len(out) == n:
                break
            entry = self.dataset[index]
            if split_of(self.name, entry["question"]) != checked:
                continue
            out.append(
                Problem(
                    prompt_id=f"{self.name}/{checked}/{index}",
                    env=self.name,
                    prompt=entry["question"],
                    answer=str(entry["answer"]),
                    split=checked,
                    fields={"index": index},
                )
            )
        return out

    def reward(self, problem: Problem, completion: str) -> RewardResult:
        entry = self.dataset[int(problem.fields["index"])]
        tagged = _ANSWER.findall(completion)
        answer = (tagged[-1] if tagged else completion).strip()
        score = float(self.dataset.score_answer(answer=answer, entry=entry))
        return RewardResult(min(1.0, max(0.0, score)), score >= 1.0)
