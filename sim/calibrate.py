"""Calibration: the simulator's per-token costs, derived from measurements of a real run.

A *profile* is a JSON file (``sim/profiles/*.json``) holding the costs the simulator uses
(``sim.scenario.CostSpec``), where each number came from, the scenario of the measured
runs (workload, cluster, policy settings of Sluice's worker), and the throughputs measured
for each variant, which ``predict`` compares against.

``measure_run`` reads what a real ``sync`` run left behind, without Ray or MLflow:
per-step times from the run's MLflow sqlite database (``perf/rollout_s``,
``perf/train_s``, ``perf/weight_sync_s``, ``train/publish_s``) and every sample's response
length from its trajectory Parquet files (``storage/schema.py``; the group id carries the
step's tag, ``r<seed * 1000003 + step>w<worker>.<place>`` after its ``@``, see
``driver/batch.py``). ``derive_costs``
fits, by least squares over the steps:

- generation of a batch on one engine = overhead + a * (longest response) + b * (sum of
  responses): the continuous-batching cost a + b * n per decode step, summed over the
  steps (n falls as responses finish, so the sum of n over the steps is the token count);
- training = fixed + per_token * (prompt + response tokens);

and takes the medians of the weight pull and the publish. Streaming decode costs (the
``async`` worker steps the engine from Python) come from ``benchmarks/sim_profile.py``,
which times the engine on this machine.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from sluice.sim.scenario import CostSpec, Scenario, ScenarioError, build_scenario, read_profile

# driver/batch.py tags a step's groups with seed * STEP_TAG + step.
STEP_TAG = 1_000_003
# A batch group's id: <prompt id>@<run tag>r<seed * STEP_TAG + step>w<worker>.<place>
# (driver/batch.py ``submit``: the shard's tag, then each worker's part of it).
BATCH_GROUP = re.compile(r"@[^@]*r(\d+)w\d+\.\d+$")


class CalibrationError(ValueError):
    """A run or profile cannot be used for calibration; the message says what is missing."""


@dataclass(frozen=True)
class StepRecord:
    """One measured sync step: its times and the lengths it generated and trained."""

    step: int
    rollout_s: float
    train_s: float
    weight_sync_s: float
    publish_s: float
    longest: int
    response_tokens: int
    prompt_tokens: int
    samples: int


@dataclass(frozen=True)
class RunMeasurements:
    """Per-step records of a sync run, and its groups' response lengths."""

    source: str
    steps: list[StepRecord]
    groups: list[list[int]]  # response lengths, one list per group, in step order
    prompt_len_mean: float
    predictor_sigma: float  # log-space error of a prompt-length-bucket length predictor


@dataclass(frozen=True)
class Profile:
    """Measured costs for one machine and the scenario and throughputs they came with."""

    name: str
    costs: CostSpec
    sources: dict[str, str]
    scenario: dict[str, Any]  # workload, cluster and policy defaults of the measured runs
    measured: dict[str, float] = field(default_factory=dict)  # variant -> samples/s
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # variant -> policy
    notes: str = ""
    # Variants whose measurements set a cost (so comparing against them checks nothing),
    # and the raw numbers behind the derived costs.
    fitted: list[str] = field(default_factory=list)
    calibration: dict[str, Any] = field(default_factory=dict)

    def scenario_for(self, variant: str) -> Scenario:
        """The measured scenario under one variant's policy."""
        if variant not in self.variants:
            raise CalibrationError(
                f"profile {self.name!r} has no variant {variant!r}; it has {sorted(self.variants)}"
            )
        return build_scenario(self.tree(self.variants[variant]))

    def tree(
        self, policy: dict[str, Any], scenario: dict[str, Any] | None = None, engines: int = 1
    ) -> dict[str, Any]:
        """A scenario as ``build_scenario`` takes it: ``scenario`` (workload, cluster, policy
        defaults; the profile's own when None) under ``policy``, with the profile's costs;
        ``engines`` > 1: that many rollout engines sharing one accelerator, each paying its
        own costs (``ENGINE_COSTS``) that many times."""
        tree = json.loads(json.dumps(self.scenario if scenario is None else scenario))
        tree["policy"] = {**tree.get("policy", {}), **policy}
        costs = self.costs.model_dump()
        if engines != 1:
            tree["cluster"] = {**tree["cluster"], "rollout_accelerators": engines}
            for key in ENGINE_COSTS:
                if costs[key] is not None:
                    costs[key] *= engines
        tree["costs"] = costs
        return tree


# The costs a rollout engine pays on its accelerator: multiplied when engines share one.
ENGINE_COSTS = (
    "decode_step_s",
    "decode_per_request_s",
    "stream_decode_step_s",
    "stream_per_request_s",
    "prefill_per_token_s",
    "batch_overhead_s",
    "group_overhead_s",
    "sync_latency_s",
)


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON; a bare name means ``sim/profiles/<name>.json``."""
    try:
        file, raw = read_profile(path)
    except ScenarioError as error:
        raise CalibrationError(str(error)) from None
    try:
        costs = CostSpec.model_validate(raw["costs"])
    except (KeyError, ValueError) as error:
        raise CalibrationError(f"profile {str(file)!r} is not a valid profile: {error}") from None
    return Profile(
        name=raw.get("name", file.stem),
        costs=costs,
        sources=dict(raw.get("sources", {})),
        scenario=dict(raw.get("scenario", {})),
        measured={k: float(v) for k, v in raw.get("measured", {}).items()},
        variants=dict(raw.get("variants", {})),
        notes=str(raw.get("notes", "")),
        fitted=list(raw.get("fitted", [])),
        calibration=dict(raw.get("calibration", {})),
    )


def save_profile(profile: Profile, path: str | Path) -> None:
    body = {
        "name": profile.name,
        "notes": profile.notes,
        "costs": profile.costs.model_dump(),
        "sources": profile.sources,
        "measured": profile.measured,
        "fitted": profile.fitted,
        "calibration": profile.calibration,
        "variants": profile.variants,
        "scenario": profile.scenario,
    }
    Path(path).write_text(_pretty(body) + "\n")


def _pretty(value: Any, depth: int = 0) -> str:
    """JSON with one key per line, but lists of numbers on one line (the length table)."""
    pad, inner = " " * depth, " " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{json.dumps(k)}: {_pretty(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and not all(isinstance(v, int | float) for v in value):
        items = [f"{inner}{_pretty(v, depth + 1)}" for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return json.dumps(value)


# -- reading a run -------------------------------------------------------------------------


def _metrics(db: Path, run_id: str) -> dict[str, dict[int, float]]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute(
            "SELECT key, step, value FROM metrics WHERE run_uuid = ?", (run_id,)
        ).fetchall()
    out: dict[str, dict[int, float]] = {}
    for key, step, value in rows:
        out.setdefault(key, {})[int(step)] = float(value)
    return out


def measure_run(run_dir: str | Path, seed: int = 0) -> RunMeasurements:
    """Per-step times and lengths of a finished ``sync`` run under ``run_dir``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = Path(run_dir)
    # every run under a root shares <root>/mlflow.db; summary.json names this run's id
    db, folder, summary = run.parent / "mlflow.db", run / "trajectories", run / "summary.json"
    if not db.is_file() or not folder.is_dir() or not summary.is_file():
        raise CalibrationError(
            f"{run} has no trajectories/ or summary.json, or its root no mlflow.db: pass the "
            "folder of a finished sync run (runs/<name>)"
        )
    metrics = _metrics(db, json.loads(summary.read_text())["mlflow_run_id"])
    needed = ("perf/rollout_s", "perf/train_s", "perf/weight_sync_s", "train/publish_s")
    missing = [k for k in needed if k not in metrics]
    if missing:
        raise CalibrationError(f"{db} lacks metrics {missing}; is it a Sluice sync run?")
    files = sorted(folder.glob("*.parquet"))
    columns = ["group_id", "response_len", "prompt_len"]
    table = pa.concat_tables([pq.read_table(f, columns=columns) for f in files])
    per_step: dict[int, dict[str, list[int]]] = {}
    prompt_lens: list[int] = []
    by_group: dict[str, list[int]] = {}
    group_prompt: dict[str, int] = {}
    for group, length, prompt in zip(
        table.column("group_id").to_pylist(),
        table.column("response_len").to_pylist(),
        table.column("prompt_len").to_pylist(),
        strict=True,
    ):
        step = _tagged_step(group) - seed * STEP_TAG
        entry = per_step.setdefault(step, {"lengths": [], "prompts": []})
        entry["lengths"].append(int(length))
        entry["prompts"].append(int(prompt))
        prompt_lens.append(int(prompt))
        by_group.setdefault(group, []).append(int(length))
        group_prompt[group] = int(prompt)
    records = []
    for step in sorted(per_step):
        if step not in metrics["perf/rollout_s"]:
            continue
        lengths, prompts = per_step[step]["lengths"], per_step[step]["prompts"]
        records.append(
            StepRecord(
                step=step,
                rollout_s=metrics["perf/rollout_s"][step],
                train_s=metrics["perf/train_s"][step],
                weight_sync_s=metrics["perf/weight_sync_s"][step],
                publish_s=metrics["train/publish_s"].get(step, 0.0),
                longest=max(lengths),
                response_tokens=sum(lengths),
                prompt_tokens=sum(prompts),
                samples=len(lengths),
            )
        )
    if len(records) < 8:
        raise CalibrationError(f"{run} has {len(records)} measured steps; calibration needs 8")
    groups = [by_group[g] for g in sorted(by_group, key=_step_order)]
    return RunMeasurements(
        source=str(run),
        steps=records,
        groups=groups,
        prompt_len_mean=statistics.fmean(prompt_lens),
        predictor_sigma=_bucket_predictor_error(by_group, group_prompt),
    )


def _tagged_step(group: str) -> int:
    """The step tag of a batch group's id (``BATCH_GROUP``)."""
    found = BATCH_GROUP.search(group)
    if found is None:
        raise CalibrationError(f"group id {group!r} has no step tag: not a sync run")
    return int(found.group(1))


def _step_order(group: str) -> tuple[int, str]:
    return _tagged_step(group), group


def _bucket_predictor_error(by_group: dict[str, list[int]], prompt: dict[str, int]) -> float:
    """Log-space error of predicting a group's mean length by its prompt-length bucket.

    Sluice's ``LengthPredictor`` falls back to the mean of the prompt's power-of-two
    length bucket for prompts it has not seen, which is every prompt of a run shorter
    than one epoch.
    """
    buckets: dict[int, list[float]] = {}
    for group, lengths in by_group.items():
        buckets.setdefault(prompt[group].bit_length(), []).append(statistics.fmean(lengths))
    errors = []
    for group, lengths in by_group.items():
        guess = statistics.fmean(buckets[prompt[group].bit_length()])
        errors.append(math.log(guess / max(statistics.fmean(lengths), 1e-9)))
    return statistics.pstdev(errors)


# -- fitting -------------------------------------------------------------------------------


def nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (columns that come out negative are
    dropped and the rest refitted: a cost cannot be negative, and with few columns this is
    the exact non-negative solution)."""
    keep = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            out = np.zeros(x.shape[1])
            out[keep] = np.maximum(coef, 0.0)
            return out
        keep = [k for k, c in zip(keep, coef, strict=True) if c >= 0] or keep[:1]


def r_squared(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> float:
    residual = float(((x @ coef - y) ** 2).sum())
    total = float(((y - y.mean()) ** 2).sum())
    return 1.0 - residual / total if total > 0 else 1.0


@dataclass(frozen=True)
class StreamMeasurements:
    """Seconds per streaming engine step against running requests, timed on this machine."""

    running: list[int]
    step_s: list[float]
    source: str


def derive_costs(
    run: RunMeasurements, stream: StreamMeasurements | None, skip_steps: int = 3
) -> tuple[CostSpec, dict[str, str]]:
    """Costs for the simulator from a sync run (and streaming step times), with sources."""
    rows = [r for r in run.steps if r.step > skip_steps]
    x = np.array([[1.0, r.longest, r.response_tokens] for r in rows])
    y = np.array([r.rollout_s for r in rows])
    gen = nonnegative_fit(x, y)
    xt = np.array([[1.0, r.response_tokens + r.prompt_tokens] for r in rows])
    yt = np.array([r.train_s for r in rows])
    train = nonnegative_fit(xt, yt)
    publish = statistics.median(r.publish_s for r in rows)
    pull = statistics.median(r.weight_sync_s for r in rows)
    groups_per_step = len(run.groups) / len(run.steps)
    where = f"{run.source}, steps {rows[0].step}-{rows[-1].step}"
    sources = {
        "decode_step_s": f"least squares of perf/rollout_s on (1, longest, sum of lengths) "
        f"per step, {where}; R^2 {r_squared(x, y, gen):.2f}",
        "decode_per_request_s": "same fit",
        "batch_overhead_s": "same fit (intercept: scoring, store put, call overhead)",
        "group_overhead_s": "batch_overhead_s per group: the streaming worker scores and "
        "puts each group itself",
        "train_step_s": f"least squares of perf/train_s on (1, trained tokens), {where}; "
        f"R^2 {r_squared(xt, yt, train):.2f}; minus the publish time",
        "train_per_token_s": "same fit",
        "publish_s": f"median train/publish_s, {where}",
        "sync_latency_s": f"median perf/weight_sync_s (a full pull into vLLM), {where}",
    }
    costs: dict[str, Any] = {
        "decode_step_s": float(gen[1]),
        "decode_per_request_s": float(gen[2]),
        "batch_overhead_s": float(gen[0]),
        "group_overhead_s": float(gen[0]) / groups_per_step,
        "train_step_s": max(float(train[0]) - publish, 0.0),
        "train_per_token_s": float(train[1]),
        "publish_s": publish,
        "model_bytes": 0.0,
        "sync_latency_s": pull,
        "prefill_per_token_s": 0.0,
    }
    if stream is not None:
        xs = np.array([[1.0, n] for n in stream.running])
        ys = np.array(stream.step_s)
        fit = nonnegative_fit(xs, ys)
        costs["stream_decode_step_s"] = float(fit[0])
        costs["stream_per_request_s"] = float(fit[1])
        sources["stream_decode_step_s"] = (
            f"least squares of streaming step time on (1, running), {stream.source}; "
            f"R^2 {r_squared(xs, ys, fit):.2f}; times calibration.stream_factor"
        )
        sources["stream_per_request_s"] = "same fit"
    sources["prefill_per_token_s"] = "0: prompts are ~8 tokens; part of the generation intercept"
    sources["model_bytes"] = "0: the pull latency is measured whole"
    return CostSpec.model_validate(costs), sources


def train_overlap(
    sync_step_s: float, sync_idle: float, one_step_s: float, one_idle: float
) -> float:
    """How much longer a training step takes while generation runs beside it.

    From the measured modes: the trainer's busy time per step is step x (1 - idle) in
    ``sync`` (alone) and in ``one_step`` (overlapped, and trainer-bound so the wait for the
    next batch's weights is small).
    """
    alone = sync_step_s * (1.0 - sync_idle)
    overlapped = one_step_s * (1.0 - one_idle)
    if alone <= 0 or overlapped <= 0:
        raise CalibrationError("trainer busy times must be positive to derive the overlap")
    return max(overlapped / alone, 1.0)


def scale_stream(costs: CostSpec, isolated: tuple[float, float], factor: float) -> CostSpec:
    """Streaming step costs: the isolated engine's, times the in-run ``factor``."""
    return costs.model_copy(
        update={
            "stream_decode_step_s": isolated[0] * factor,
            "stream_per_request_s": isolated[1] * factor,
        }
    )


# The streaming factor is searched in this range: wide enough for every fit so far (1.55,
# 0.59, 1.13 and 2.26 on four modes runs), and frozen with the fit in the profile
# (``calibration.stream_factor_bounds``) so that it is not widened to fit one run.
STREAM_FACTOR_BOUNDS = (0.25, 6.0)


def fit_stream_factor(
    profile: Profile,
    isolated: tuple[float, float],
    variant: str,
    bounds: tuple[float, float] = STREAM_FACTOR_BOUNDS,
) -> float:
    """The factor on the isolated engine's streaming decode cost that makes ``variant``'s
    simulated ratio to the baseline equal its measured one (bisection: throughput falls as
    the factor grows). It absorbs whatever the model leaves out of a streaming run, not only
    contention, so it lands on either side of 1: 1.55 fitted to the modes run of d14fd38,
    0.59 to that of 45abaec, whose isolated engine was timed on a slower machine."""
    from sluice.sim.engine import simulate

    low, high = bounds
    baseline = next(iter(profile.variants))
    target = profile.measured[variant] / profile.measured[baseline]
    base = simulate(profile.scenario_for(baseline)).samples_per_s

    def ratio(factor: float) -> float:
        trial = replace_costs(profile, scale_stream(profile.costs, isolated, factor))
        return simulate(trial.scenario_for(variant)).samples_per_s / base

    if ratio(low) < target or ratio(high) > target:
        raise CalibrationError(
            f"no streaming factor in [{low}, {high}] reproduces {variant}'s measured ratio "
            f"{target:.2f}"
        )
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if ratio(mid) > target else (low, mid)
    return (low + high) / 2


def frozen_bounds(profile: Profile) -> tuple[float, float]:
    """The streaming factor's search range frozen with the profile's fit."""
    if "stream_factor_bounds" not in profile.calibration:
        raise CalibrationError(
            f"profile {profile.name!r} keeps no calibration.stream_factor_bounds (fitted before "
            "they were frozen with the fit): fit it again with `make sim-profile`"
        )
    low, high = profile.calibration["stream_factor_bounds"]
    return float(low), float(high)


@dataclass(frozen=True)
class Refit:
    """The two fitted factors as one round of a modes measurement gives them."""

    train_overlap: float
    stream_factor: float | None  # None: no factor within the frozen bounds fits the round
    fit_ratio: float  # the round's measured ratio of the fitted variant to sync


def refit_round(profile: Profile, rows: dict[str, dict[str, float]], fit_variant: str) -> Refit:
    """Fit the training overlap and the streaming factor again, as ``make sim-profile``
    does, to one round's ``sync``, ``one_step`` and ``fit_variant`` (each a run's
    ``samples_per_s``, ``step_s`` and ``trainer_idle``), with the profile's other costs and
    frozen bounds: one draw of the spread of the fitted factors."""
    sync, one_step = rows["sync"], rows["one_step"]
    overlap = train_overlap(
        sync["step_s"], sync["trainer_idle"], one_step["step_s"], one_step["trainer_idle"]
    )
    trial = replace(
        profile,
        costs=profile.costs.model_copy(update={"train_overlap_factor": overlap}),
        measured={"sync": sync["samples_per_s"], fit_variant: rows[fit_variant]["samples_per_s"]},
    )
    isolated = profile.calibration["stream_isolated"]
    try:
        factor: float | None = fit_stream_factor(
            trial, (isolated[0], isolated[1]), fit_variant, frozen_bounds(profile)
        )
    except CalibrationError:
        factor = None
    return Refit(overlap, factor, rows[fit_variant]["samples_per_s"] / sync["samples_per_s"])


def replace_costs(profile: Profile, costs: CostSpec) -> Profile:
    return replace(profile, costs=costs)


# -- prediction ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    variant: str
    predicted_ratio: float  # simulated samples/s over the whole run, over the baseline's
    measured_ratio: float | None

    @property
    def error(self) -> float | None:
        """Relative error of the predicted ratio against the measured one."""
        if self.measured_ratio is None:
            return None
        return self.predicted_ratio / self.measured_ratio - 1.0


def predict(profile: Profile, variants: list[str] | None = None) -> list[Prediction]:
    """Simulate each variant of the profile; ratios are to its first variant (the baseline)."""
    from sluice.sim.engine import simulate

    names = variants or list(profile.variants)
    if not names:
        raise CalibrationError(f"profile {profile.name!r} lists no variants")
    baseline = next(iter(profile.variants))
    try:
        base = simulate(profile.scenario_for(baseline))
        out = []
        for name in names:
            result = simulate(profile.scenario_for(name))
            # Whole-run rates, as the measured samples/s are (summary.json: trained samples
            # over the loop's time, pipeline fill included).
            ratio = result.samples_per_s / base.samples_per_s
            measured = None
            if name in profile.measured and baseline in profile.measured:
                measured = profile.measured[name] / profile.measured[baseline]
            out.append(Prediction(name, ratio, measured))
    except ScenarioError as error:
        raise CalibrationError(f"profile {profile.name!r}: {error}") from None
    return out


def calibration_rows(profile: Profile) -> list[dict[str, Any]]:
    """Each measured variant's ratio to sync against the simulator's, with the simulated
    staleness and trainer idle beside the measured ones (None where not measured)."""
    from sluice.sim.engine import simulate

    modes = profile.calibration.get("modes", {})
    rows = []
    for p in predict(profile):
        result = simulate(profile.scenario_for(p.variant))
        row = modes.get(p.variant, {})
        rows.append(
            {
                "variant": p.variant,
                "measured": p.measured_ratio,
                "simulated": p.predicted_ratio,
                "error": p.error,
                "fitted": p.variant in profile.fitted,
                "trainer_idle": [row.get("trainer_idle"), result.trainer_idle],
                "mean_staleness": [row.get("mean_staleness"), result.mean_staleness],
            }
        )
    return rows


def calibration_table(rows: list[dict[str, Any]]) -> str:
    """Markdown of ``calibration_rows``."""

    def pair(values: list[float | None]) -> str:
        measured, simulated = values
        return f"{'-' if measured is None else f'{measured:.2f}'} / {simulated:.2f}"

    lines = [
        "| variant | measured x sync | simulated x sync | error | used to fit | "
        "trainer idle (measured / sim) | mean staleness (measured / sim) |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for r in rows:
        measured = "-" if r["measured"] is None else f"{r['measured']:.2f}"
        error = "-" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        lines.append(
            f"| {r['variant']} | {measured} | {r['simulated']:.2f} | {error} "
            f"| {'yes' if r['fitted'] else ''} | {pair(r['trainer_idle'])} "
            f"| {pair(r['mean_staleness'])} |"
        )
    return "\n".join(lines)
