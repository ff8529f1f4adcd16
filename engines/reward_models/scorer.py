"""The scoring side of a judge or reward model: a ``Scorer`` (``envs/scoring.py``) that a
rollout worker (or the driver, for held-out evaluation) builds in its process. It renders
each completion into the model's text, sends a group to one of the served actors
(``served.py``) and waits up to the timeout; what the judge answered is kept as the
sample's verdict (the trajectory row and the ledger's ``scored`` event) and ``parse``
turns it into the reward (a regular expression here, or a user's function in an isolated
reward pool). A group that times out, or whose actor died, fails its samples with the
reason; the worker goes on.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from sluice.config.tree import JudgeConfig
from sluice.engines.reward_models.judge import Answer
from sluice.engines.reward_models.served import ServedModels
from sluice.envs.base import Environment, Problem, RewardResult, score
from sluice.envs.rewards import RewardCall, RewardPool

# The reward metric of the seconds the judge or reward model computed, per sample (its
# mean times the samples of a step, over the step's seconds: the share of a step it took).
MODEL_SECONDS = "model_s"
# How much of a verdict a row and the ledger keep.
VERDICT_CHARS = 2000
_ERROR_CHARS = 300


def render(template: str, problem: Problem, completion: str) -> str:
    """``template`` filled with the problem's prompt, answer and fields and ``completion``;
    ``ValueError`` naming a field the template asks for and the problem lacks."""
    values = {**problem.fields, "prompt": problem.prompt, "answer": problem.answer,
              "completion": completion}  # fmt: skip
    try:
        return template.format_map(values)
    except KeyError as error:
        raise ValueError(
            f"the template asks for {{{error.args[0]}}}, which the problem does not have "
            f"(it has {', '.join(sorted(values))})"
        ) from None
    except (IndexError, ValueError) as error:
        raise ValueError(f"the template is not a format string: {error}") from None


def parse_verdict(verdict: str, pattern: re.Pattern[str], max_score: float) -> float:
    """The reward a verdict gives: with a group in ``pattern``, the number it captures over
    ``max_score`` (``ValueError`` unless it is one in [0, max_score]); without one, 1 when
    the pattern is found and 0 when not."""
    found = pattern.search(verdict)
    if not pattern.groups:
        return 1.0 if found else 0.0
    if found is None or found.group(1) is None:
        raise ValueError(f"judge.parse {pattern.pattern!r} does not match the verdict")
    try:
        value = float(found.group(1))
    except ValueError:
        raise ValueError(f"judge.parse captured {found.group(1)!r}, not a number") from None
    if not 0.0 <= value <= max_score:
        raise ValueError(f"judge.parse captured {value:g}, outside [0, {max_score:g}]")
    return value / max_score


class ModelScorer:
    """Scores groups with served models; ``verifier``: a built-in environment whose own
    verdict each scored sample is compared with (``agrees_with_verifier``, a reward
    metric), so a judge's agreement with the exact answer is measured as the run goes.
    ``parse_pool``: the judge's ``parse_fn`` in an isolated reward pool. ``owned``: the
    actors are this scorer's own, stopped by ``close``."""

    isolated = True

    def __init__(
        self,
        served: ServedModels,
        correct_at: float = 1.0,
        verifier: Environment | None = None,
        parse_pool: RewardPool | None = None,
        owned: bool = False,
    ) -> None:
        self.served, self.correct_at, self.verifier = served, correct_at, verifier
        self.parse_pool, self.owned = parse_pool, owned
        cfg = served.cfg
        self.judge = cfg if isinstance(cfg, JudgeConfig) else None
        self.template = self.judge.prompt if self.judge else cfg.template  # type: ignore[union-attr]
        self.pattern = re.compile(self.judge.parse) if self.judge and self.judge.parse else None
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def _actor(self) -> Any:
        with self._lock:  # groups go round the actors; several threads score at once
            return self.served.handles[next(self._turn) % len(self.served.handles)]

    def _ask(self, texts: list[str]) -> tuple[list[Answer], float]:
        """The served model's answers and the seconds it computed them in, or one failure
        for all when the call fails."""
        kind, timeout = self.served.kind, self.served.cfg.timeout_s
        ref = self._actor().score.remote(texts)
        try:
            answers, seconds = ray.get(ref, timeout=timeout)
            return answers, seconds
        except GetTimeoutError:
            ray.cancel(ref)
            why = f"the {kind} gave no answer within {timeout:g} s (reward.*.timeout_s)"
        except (RayActorError, RayTaskError) as error:
            why = f"the {kind} failed: {str(error).splitlines()[0] if str(error) else error!r}"
        return [(None, why[:_ERROR_CHARS])] * len(texts), 0.0

    def score(
        self,
        problems: Sequence[Problem],
        completions: Sequence[Sequence[str]],
        lengths: Sequence[Sequence[int]],
    ) -> list[list[RewardResult]]:
        pairs = [(p, c) for p, group in zip(problems, completions, strict=True) for c in group]
        texts: list[str] = []
        bad: dict[int, str] = {}
        for i, (problem, completion) in enumerate(pairs):
            try:
                texts.append(render(self.template, problem, completion))
            except ValueError as error:
                bad[i] = f"{self.served.kind} template: {error}"[:_ERROR_CHARS]
                texts.append("")
        asked = [i for i in range(len(pairs)) if i not in bad]
        answers: list[Answer] = [(None, bad.get(i)) for i in range(len(pairs))]
        seconds = 0.0
        if asked:
            got, seconds = self._ask([texts[i] for i in asked])
            for i, answer in zip(asked, got, strict=True):
                answers[i] = answer
        results = self._results(pairs, answers)
        if seconds:  # the model's time, shared among the samples it scored
            share = {MODEL_SECONDS: seconds / len(asked)}
            results = [
                replace(r, metrics={**r.metrics, **share}) if r.error is None else r
                for r in results
            ]
        out = iter(results)
        return [[next(out) for _ in group] for group in completions]

    def _results(
        self, pairs: list[tuple[Problem, str]], answers: list[Answer]
    ) -> list[RewardResult]:
        results: list[RewardResult] = []
        verdicts = [
            str(value)[:VERDICT_CHARS] if self.judge and value is not None else None
            for value, _ in answers
        ]
        parsed = self._parsed_by_function(pairs, answers, verdicts)
        for i, ((problem, completion), (value, error)) in enumerate(
            zip(pairs, answers, strict=True)
        ):
            verdict = verdicts[i]
            if error is None and parsed is not None:
                results.append(RewardResult(**{**parsed[i], "verdict": verdict}))
                continue
            if error is None:
                try:
                    reward = (
                        parse_verdict(str(value), self.pattern, self.judge.max_score)  # type: ignore[arg-type]
                        if self.judge
                        else float(value)
                    )
                except ValueError as why:
                    error = str(why)[:_ERROR_CHARS]
            if error is not None:
                results.append(RewardResult(0.0, False, error, {}, verdict))
                continue
            correct = reward >= self.correct_at
            results.append(
                RewardResult(reward, correct, None, self._agreement(problem, completion, correct),
                             verdict)
            )  # fmt: skip
        return results

    def _parsed_by_function(
        self, pairs: list[tuple[Problem, str]], answers: list[Answer], verdicts: list[str | None]
    ) -> list[dict[str, Any]] | None:
        """``parse_fn``'s outcome for each answered sample (as RewardResult's fields)."""
        if self.parse_pool is None:
            return None
        index = [i for i, (_, error) in enumerate(answers) if error is None]
        calls = [
            RewardCall(pairs[i][0].prompt, pairs[i][1],
                       {"answer": pairs[i][0].answer, **pairs[i][0].fields, "verdict": verdicts[i]})
            for i in index
        ]  # fmt: skip
        out: list[dict[str, Any]] = [{} for _ in pairs]
        for i, o in zip(index, self.parse_pool.score(calls) if calls else [], strict=True):
            metrics: Mapping[str, float] = o.metrics
            if o.error is None:
                metrics = {**metrics, **self._agreement(pairs[i][0], pairs[i][1], o.correct)}
            out[i] = {"reward": o.reward, "correct": o.correct, "error": o.error,
                      "metrics": dict(metrics)}  # fmt: skip
        return out

    def _agreement(self, problem: Problem, completion: str, correct: bool) -> dict[str, float]:
        if self.verifier is None:
            return {}
        exact = score(self.verifier, problem, completion)
        if exact.error is not None:
            return {}
        return {"agrees_with_verifier": float(exact.correct == correct)}

    def close(self) -> None:
        if self.parse_pool is not None:
            self.parse_pool.close()
        if self.owned:
            self.served.close()
