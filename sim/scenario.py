"""The simulator's typed scenario: workload, cluster, costs and policy, loaded from YAML.

One pydantic tree, the same way ``sluice/config/tree.py`` holds a run: every field has a
description, unknown keys are errors, and ``load_scenario`` turns validation errors into
one ``ScenarioError`` that names each bad field. The policy's settings that a Sluice run
has are that run's own pydantic fields (``sluice/config/tree.py``: ``mode``, ``max_staleness``,
``rollout.partial_rollout``, ``rollout.long_first``, ``rollout.balance``, ``rollout.repack*``),
so a scenario defaults to what a run does; the costs are per accelerator and come from a
calibration profile (``sim/calibrate.py``) or from stated public numbers
(``benchmarks/sim_scale.py``).
"""

from __future__ import annotations

import json
from copy import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sluice.config.tree import RolloutConfig, RunConfig, apply_override
from sluice.rl.staleness import StaleBy

# Calibration profiles shipped with the package (written by benchmarks/sim_profile.py).
PROFILES = Path(__file__).parent / "profiles"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LengthSpec(_Section):
    """How long responses are: a long-tail draw, or lengths replayed from a real run."""

    kind: Literal["lognormal", "mixture", "constant", "groups", "replay"] = Field(
        "lognormal",
        description="lognormal: log-normal around `median`. mixture: the same, plus a "
        "`tail_fraction` of samples drawn around `tail_median`. constant: every response "
        "is `median` tokens. groups: the lengths given in `groups`, in order, cycled. "
        "replay: whole groups resampled from a run's trajectories.",
    )
    median: float = Field(512.0, gt=0, description="Median response tokens (constant: all).")
    sigma: float = Field(
        0.6, ge=0, description="Log-space spread of one response around its prompt's median."
    )
    group_sigma: float = Field(
        0.6,
        ge=0,
        description="Log-space spread of prompt medians: the part of the skew that belongs to "
        "the prompt, which a length predictor can learn.",
    )
    tail_fraction: float = Field(
        0.0, ge=0, le=1, description="mixture: share of responses drawn from the tail."
    )
    tail_median: float = Field(8192.0, gt=0, description="mixture: median of tail responses.")
    tail_sigma: float = Field(0.5, ge=0, description="mixture: log-space spread of the tail.")
    max_tokens: int = Field(16384, ge=1, description="Responses are cut at this many tokens.")
    groups: list[list[int]] | None = Field(
        None,
        description="groups: response lengths of consecutive groups (each list one group of "
        "samples_per_group lengths); group i of the run gets entry i modulo their number.",
    )
    replay: str | None = Field(
        None,
        description="replay: a run folder (runs/<name>), its trajectories/ folder, or a "
        "storage URL (file:// or s3://) whose trajectories/ hold Parquet rows.",
    )
    replay_scale: float = Field(
        1.0, gt=0, description="replay: multiply every replayed length by this."
    )

    @model_validator(mode="after")
    def _source_given(self) -> LengthSpec:
        if self.kind == "replay" and not self.replay:
            raise ValueError("lengths.kind 'replay' needs lengths.replay (a run or storage URL)")
        if self.kind == "groups":
            if not self.groups:
                raise ValueError("lengths.kind 'groups' needs lengths.groups (lists of lengths)")
            sizes = {len(g) for g in self.groups}
            if len(sizes) != 1 or min(min(g) for g in self.groups) < 1:
                raise ValueError(
                    "lengths.groups must be lists of equal size with lengths of at least 1"
                )
        return self


class WorkloadSpec(_Section):
    """What one run trains on: steps, batch shape, prompt and response lengths."""

    steps: int = Field(100, ge=1, description="Training steps (optimiser steps) to simulate.")
    groups_per_step: int = Field(
        64, ge=1, description="Prompt groups per step (rollout.prompts_per_step)."
    )
    samples_per_group: int = Field(
        8, ge=1, description="Responses per prompt, the GRPO group (rollout.samples_per_prompt)."
    )
    prompt_tokens: int = Field(256, ge=0, description="Prompt tokens per sample.")
    lengths: LengthSpec = Field(default_factory=LengthSpec, description="Response lengths.")
    warmup_steps: int = Field(
        2, ge=0, description="Steps left out of the steady-state rate (the pipeline fills)."
    )

    @property
    def batch_samples(self) -> int:
        return self.groups_per_step * self.samples_per_group


class ClusterSpec(_Section):
    """The accelerators: a rollout pool and a trainer, apart or on the same devices."""

    placement: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="disaggregated: rollout and training run on separate accelerators and can "
        "overlap. colocated: the same accelerators generate, then train (sync only).",
    )
    rollout_accelerators: int = Field(8, ge=1, description="Accelerators that generate.")
    train_accelerators: int = Field(
        8, ge=1, description="Accelerators that train (colocated: the same ones, so equal)."
    )
    accelerators_per_instance: int = Field(
        1, ge=1, description="Accelerators per rollout engine (its tensor-parallel size)."
    )
    max_concurrency: int = Field(
        256, ge=1, description="Requests in one engine's running batch at most (vLLM max_num_seqs)."
    )
    failure_rate_per_hour: float = Field(
        0.0, ge=0, description="Failures or preemptions per rollout engine per hour."
    )
    repair_s: float = Field(
        300.0, ge=0, description="Seconds a failed rollout engine is away before it returns."
    )

    @model_validator(mode="after")
    def _shapes(self) -> ClusterSpec:
        if self.rollout_accelerators % self.accelerators_per_instance:
            raise ValueError(
                f"cluster.accelerators_per_instance ({self.accelerators_per_instance}) must "
                f"divide cluster.rollout_accelerators ({self.rollout_accelerators})"
            )
        if self.placement == "colocated" and self.rollout_accelerators != self.train_accelerators:
            raise ValueError(
                "colocated placement shares the accelerators: cluster.rollout_accelerators "
                f"({self.rollout_accelerators}) must equal cluster.train_accelerators "
                f"({self.train_accelerators})"
            )
        return self

    @property
    def instances(self) -> int:
        """Rollout engines."""
        return self.rollout_accelerators // self.accelerators_per_instance

    @property
    def accelerators(self) -> int:
        """Accelerators in the cluster."""
        if self.placement == "colocated":
            return self.rollout_accelerators
        return self.rollout_accelerators + self.train_accelerators


class CostSpec(_Section):
    """What each piece of work costs, in seconds, per rollout engine or per trainer.

    The defaults are a 7B model on H100s as ``sim/hardware.py`` derives it (decode at a
    ~1k-token context, bf16 weights over a 400 Gb/s link).
    """

    decode_step_s: float = Field(
        0.0065, ge=0, description="One decode step of an engine, whatever its batch (a)."
    )
    decode_per_request_s: float = Field(
        1e-4, ge=0, description="Extra cost of one decode step per running request (b)."
    )
    stream_decode_step_s: float | None = Field(
        None,
        description="async: a decode step of the streaming loop (Sluice steps the engine from "
        "Python and handles every delta); empty: decode_step_s.",
    )
    stream_per_request_s: float | None = Field(
        None, description="async: per running request per streaming step; empty: as batch."
    )
    prefill_per_token_s: float = Field(
        3.1e-5,
        ge=0,
        description="Prefill per prompt token, paid once per group (prefix caching shares "
        "the prompt across its samples).",
    )
    batch_overhead_s: float = Field(
        0.0,
        ge=0,
        description="sync/one_step: fixed cost of one generate call per engine (scoring, store "
        "put, call overhead).",
    )
    group_overhead_s: float = Field(
        0.0,
        ge=0,
        description="async: engine time per finished group (scoring, building its block, the "
        "store put), spent in the worker's loop between decode steps.",
    )
    group_ready_s: float = Field(
        0.0,
        ge=0,
        description="async: the longest a finished group waits in its engine's put buffer "
        "before the trainer can lease it (see policy.put_groups).",
    )
    train_step_s: float = Field(2.2, ge=0, description="Fixed cost of one optimiser step.")
    train_per_token_s: float = Field(
        1.5e-4,
        ge=0,
        description="Accelerator-seconds per trained token (prompt + response; forward, "
        "backward, log-prob recompute); divided by train_accelerators.",
    )
    publish_s: float = Field(0.0, ge=0, description="Trainer time to publish a weight version.")
    model_bytes: float = Field(15.2e9, ge=0, description="Bytes of weights an engine loads.")
    sync_bandwidth_bytes_per_s: float = Field(
        25e9, gt=0, description="Bandwidth of one engine's weight pull."
    )
    sync_latency_s: float = Field(0.5, ge=0, description="Fixed cost of one weight load.")
    train_overlap_factor: float = Field(
        1.0,
        ge=1.0,
        description="one_step/async: training takes this many times longer because "
        "generation runs beside it on shared host cores (1 on a cluster; measured on small "
        "machines, see sim/profiles).",
    )
    colocated_switch_s: float = Field(
        0.0,
        ge=0,
        description="colocated: per step, swapping the accelerators between the rollout "
        "engine and the trainer (offload, reload, cache rebuild).",
    )

    @property
    def pull_s(self) -> float:
        """Seconds one engine spends loading a new weight version."""
        return self.model_bytes / self.sync_bandwidth_bytes_per_s + self.sync_latency_s


# Sluice's skew handling (dispatch and repack) switched off, which a run has on by default:
# the baseline that comparisons turn one option on from at a time.
SKEW_HANDLING_OFF: dict[str, Any] = {"long_first": False, "balance": False, "repack": False}


def _run_setting(section: type[BaseModel], name: str) -> Any:
    """The field ``name`` of a section of Sluice's run config (``sluice/config/tree.py``): its
    default, bounds and description, so the scenario accepts and defaults to what a run does."""
    return copy(section.model_fields[name])


class PolicySpec(_Section):
    """Which scheduling policy runs: Sluice's modes and switches, and how its worker behaves.

    The settings a Sluice run has are its own fields: ``mode`` and ``max_staleness`` of
    ``RunConfig``, the dispatch and repack switches of ``RolloutConfig``
    (``sluice/config/tree.py``), with their defaults, bounds and descriptions. Skew-aware
    dispatch is StreamRL's (``long_first``, ``balance``; ``rl.dispatch.plan``), repack
    Laminar's (``rl.dispatch.stragglers``). A run uses them in ``async`` only; the simulator applies
    them in ``sync`` and ``one_step`` too, where Sluice submits round robin, so a batch-mode
    comparison that should match Sluice turns them off (``SKEW_HANDLING_OFF``).

    The other fields are the simulator's own: the real values are constants or settings of
    the worker and dispatcher (``engines/``, which the simulator does not import) or
    behaviour the simulator lets you switch.
    """

    mode: Literal["sync", "one_step", "async"] = _run_setting(RunConfig, "mode")
    max_staleness: int = _run_setting(RunConfig, "max_staleness")
    stale_by: StaleBy = _run_setting(RunConfig, "stale_by")
    partial_rollout: bool = _run_setting(RolloutConfig, "partial_rollout")
    long_first: bool = _run_setting(RolloutConfig, "long_first")
    balance: bool = _run_setting(RolloutConfig, "balance")
    repack: bool = _run_setting(RolloutConfig, "repack")
    repack_max_stragglers: int = _run_setting(RolloutConfig, "repack_max_stragglers")
    repack_min_age_s: float = _run_setting(RolloutConfig, "repack_min_age_s")

    # Simulator only: Sluice's dispatcher learns lengths online (rl.dispatch.LengthPredictor);
    # the simulator draws its error instead.
    predictor_sigma: float = Field(
        0.3,
        ge=0,
        description="Log-space error of the length predictor per group (0: it knows each "
        "group's mean length exactly).",
    )
    # Simulator only, here and in the next two: constants and settings of Sluice's worker
    # (engines/rollout/worker.py, engines/rollout/messages.py), not of a run's config. The defaults
    # are an idealised worker; the cpu2core profile sets Sluice's values.
    refill_at: float = Field(
        0.0,
        ge=0,
        le=1,
        description="async: an engine asks for work once this share of its batch is free "
        "(Sluice's worker: 0.25), or when it runs nothing.",
    )
    weight_check_s: float = Field(
        0.0,
        ge=0,
        description="async: engines look for new weights this often (Sluice's worker: 0.1 s); "
        "0: the moment they are published.",
    )
    put_groups: int = Field(
        1,
        ge=1,
        description="async: an engine puts its finished groups in the store together, once "
        "this many wait or the oldest has waited costs.group_ready_s (Sluice's worker: 8, "
        "PUT_GROUPS); 1: each group at once.",
    )
    # Simulator only: a constant of Sluice's dispatcher (LOOKAHEAD_STEPS in
    # engines/rollout/dispatcher.py), not a setting of a run.
    lookahead_steps: int = Field(
        2, ge=1, description="async dispatch: steps of upcoming groups the dispatcher orders."
    )
    # Simulator only: Sluice's dispatcher always gives the slot back (engines/rollout/dispatcher.py,
    # ``credit``); the switch shows what the rule without it costs.
    credit_drops: bool = Field(
        True,
        description="async: a dropped group gives its admission slot back, as Sluice's "
        "dispatcher does. Off: every group handed out counts against admission, which can "
        "stall training once more than max_staleness batches were dropped.",
    )

    @property
    def label(self) -> str:
        if self.mode != "async":
            return self.mode
        extra = []
        if self.long_first or self.balance:
            extra.append("dispatch")
        if self.repack:
            extra.append("repack")
        if not self.partial_rollout:
            extra.append("no partial")
        if self.stale_by == "first_token":
            extra.append("first-token")
        if not self.credit_drops:
            extra.append("no credit")
        return f"async k={self.max_staleness}" + "".join(f" +{e}" for e in extra)


class Scenario(_Section):
    """One simulation: what is trained, on what, at what cost, under which policy."""

    name: str = Field("scenario", description="Label in tables.")
    seed: int = Field(0, ge=0, description="Seed of every random draw (lengths, failures).")
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec, description="Workload.")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="Cluster.")
    costs: CostSpec = Field(default_factory=CostSpec, description="Costs.")
    policy: PolicySpec = Field(default_factory=PolicySpec, description="Policy.")

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        lengths, group = self.workload.lengths, self.workload.samples_per_group
        if lengths.kind == "groups" and lengths.groups and len(lengths.groups[0]) != group:
            raise ValueError(
                f"workload.lengths.groups hold groups of {len(lengths.groups[0])} lengths, but "
                f"workload.samples_per_group is {group}"
            )
        if self.policy.mode == "async" and self.cluster.max_concurrency < group:
            raise ValueError(
                f"async hands out whole groups: cluster.max_concurrency "
                f"({self.cluster.max_concurrency}) must be at least workload.samples_per_group "
                f"({group})"
            )
        if self.cluster.placement == "colocated" and self.policy.mode != "sync":
            raise ValueError(
                f"colocated placement runs only policy.mode 'sync' (got {self.policy.mode!r}): "
                "generation and training share the accelerators, so they cannot overlap"
            )
        return self

    def with_policy(self, **changes: Any) -> Scenario:
        """This scenario under another policy (fields of PolicySpec), validated again."""
        tree = self.model_dump()
        tree["policy"].update(changes)
        return build_scenario(tree)


class ScenarioError(ValueError):
    """A scenario file or override is wrong; the message names the field and what is allowed."""


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(p) for p in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown key")
        else:
            lines.append(f"{where}: {item['msg']} (got {item.get('input')!r})")
    return "invalid scenario: " + "; ".join(lines)


def read_profile(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The file and JSON of a profile (``sim/calibrate.py``); a bare name means
    ``sim/profiles/<name>.json``."""
    file = Path(path)
    if not file.suffix and not file.exists():
        file = PROFILES / f"{file}.json"
    if not file.is_file():
        raise ScenarioError(f"profile {str(path)!r} not found (looked at {file})")
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ScenarioError(f"profile {str(file)!r} is not valid JSON: {error}") from None
    if not isinstance(raw, dict):
        raise ScenarioError(f"profile {str(file)!r} must hold a JSON object")
    return file, raw


def build_scenario(tree: dict[str, Any]) -> Scenario:
    """Validate a nested dict into a Scenario; ``profile: <json>`` fills in ``costs``.

    A profile (``sim/calibrate.py``) supplies measured costs; keys under ``costs`` in the
    tree override it.
    """
    tree = dict(tree)
    profile = tree.pop("profile", None)
    if profile is not None:
        try:
            measured = CostSpec.model_validate(read_profile(Path(str(profile)))[1]["costs"])
        except (KeyError, ValueError) as error:
            raise ScenarioError(
                f"profile {str(profile)!r} is not a valid profile: {error}"
            ) from None
        tree["costs"] = {**measured.model_dump(), **(tree.get("costs") or {})}
    try:
        return Scenario.model_validate(tree)
    except ValidationError as error:
        raise ScenarioError(_describe(error)) from None


def load_scenario(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    profile: str | None = None,
) -> Scenario:
    """Read a YAML (or JSON) scenario, then apply ``section.field=value`` overrides.

    ``profile`` (a calibration profile's name or path) replaces the file's ``profile:``;
    costs given in the file or the overrides still win over the profile's.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if not file.is_file():
            raise ScenarioError(f"scenario file {str(file)!r} does not exist")
        try:
            text = file.read_text()
            loaded = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
        except (yaml.YAMLError, json.JSONDecodeError) as error:
            raise ScenarioError(f"scenario file {str(file)!r} is not valid: {error}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ScenarioError(f"scenario file {str(file)!r} must hold a mapping")
        tree = loaded or {}
    if profile is not None:
        tree["profile"] = profile
    for assignment in overrides:
        try:
            apply_override(tree, assignment)
        except ValueError as error:
            raise ScenarioError(str(error)) from None
    return build_scenario(tree)
