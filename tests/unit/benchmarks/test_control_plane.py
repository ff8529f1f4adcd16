"""benchmarks/control_plane.py: the demand it derives from the simulator, the headroom and
cost arithmetic, the percentiles and profiles it summarises, the clock engine its rollout
workers run on, one small real level (Ray, the real rollout workers' stream loop) whose
ledger comes out exactly once, and the section written from a record of what was measured."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks.control_plane import (
    GROUP,
    HOSTS,
    MAX_NEW_TOKENS,
    Ceiling,
    ClockEngine,
    Costs,
    Demand,
    Latency,
    LevelResult,
    Load,
    Measurement,
    ProbeResult,
    WorkerHost,
    demand_of,
    find_ceiling,
    headroom,
    largest_demand,
    length_pool,
    parse_levels,
    percentile,
    projected,
    ramp_levels,
    ramp_text,
    render,
    run_level,
    setup,
    simulated_demand,
    summarise,
    take_cost,
    take_costs,
    top_frames,
    verdict,
)
from benchmarks.records import Record
from sluice.engines.protocols import Delta

# A 7B-like cell at 1024 accelerators: 418 engines of 256 requests on one accelerator each,
# 640 generated samples/s (40 groups of 16), 512 trained.
SEVEN_B = Demand("7B", 1024, "p", engines=418, concurrency=256, samples_s=640.0,
                 trained_s=512.0, accelerators_per_engine=1, group=16,
                 groups_per_step=512)  # fmt: skip


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        (list(range(1, 101)), 50, 50),  # the 50th of 100 values
        (list(range(1, 101)), 99, 99),
        (list(range(100, 0, -1)), 99, 99),  # order does not matter
        ([7.0], 50, 7.0),
        ([1, 2, 3, 4], 50, 2),  # nearest rank: ceil(0.5 * 4) = 2nd value
        ([1, 2, 3, 4], 100, 4),
    ],
    ids=["p50-of-100", "p99-of-100", "unsorted", "one-value", "even-count", "p100"],
)
def test_nearest_rank_percentiles(values, p, expected):
    assert percentile(values, p) == expected


def test_no_latencies_summarise_to_a_dash_and_a_bad_percentile_is_refused():
    empty = summarise([])
    assert empty.count == 0 and math.isnan(empty.p50) and empty.ms() == "-"
    assert summarise([0.001, 0.002, 0.1]).ms() == "2.0 / 100.0"
    with pytest.raises(ValueError, match="percentile"):
        percentile([1.0], 0)


def test_demand_turns_sample_rates_into_the_real_workers_calls():
    d = SEVEN_B
    assert d.groups_s == 40.0
    # 40 groups/s over 418 engines: under one group per engine per PUT_EVERY_S, a put a group.
    assert d.puts_s == 40.0
    # A take brings REFILL_AT (0.25) x 256 requests / 16 = 4 groups.
    assert (d.groups_per_take, d.takes_s) == (4, 10.0)
    assert d.leases_s == 512.0 / (512 * 16)
    assert d.reports_s == 100  # 418 engines every 0.5 s, paced to REPORTS_PER_S
    assert d.checks_s == pytest.approx(418 / 0.1)  # every engine every weight_check_s
    assert d.checks_per_relay_s == pytest.approx(8 / 0.1)  # the 8 engines of a node
    assert d.pulls_s == pytest.approx(418 * d.leases_s)  # every engine, every version
    assert d.held_takes_s == pytest.approx(418 * d.leases_s)  # an empty answer a version


def test_a_small_fleet_reports_at_its_own_pace_and_big_engines_share_a_relay_less():
    d = Demand("32B", 64, "p", 18, 79, 5.0, 5.0, accelerators_per_engine=2, group=16)
    assert d.reports_s == 18 / 0.5  # under the fleet's budget: every report_every_s
    assert d.checks_per_relay_s == pytest.approx(4 / 0.1)  # 4 engines of 2 on a node


@pytest.mark.parametrize(
    ("concurrency", "groups_per_take"),
    [(256, 4), (79, 2), (16, 1), (8, 1)],
    ids=["7B-engine", "32B-engine", "one-group", "less-than-a-group"],
)
def test_a_take_brings_a_quarter_of_the_engine_in_whole_groups(concurrency, groups_per_take):
    d = Demand("m", 64, "p", 10, concurrency, 160.0, 160.0, group=16)
    assert d.groups_per_take == groups_per_take


def test_a_busy_engine_puts_up_to_put_groups_groups_a_block():
    # One engine finishing 100 groups/s: 25 in a PUT_EVERY_S, capped at PUT_GROUPS (8).
    d = Demand("m", 1, "p", 1, 256, 1600.0, 1600.0, group=16)
    assert d.puts_s == 100 / 8


def test_demand_of_a_simulated_run_is_its_steady_state():
    # A batch of 512 x 16 every 32 s in the steady state: 256 trained a second; over the
    # whole run 300 dropped for 2400 trained, so 256 x 2700 / 2400 = 288 samples/s end.
    result = SimpleNamespace(steady_step_s=32.0, trained_samples=2400, dropped_samples=300)
    cluster = SimpleNamespace(instances=26, max_concurrency=256, accelerators_per_instance=2)
    d = demand_of("7B", 64, "async", result, cluster)  # type: ignore[arg-type]
    assert (d.samples_s, d.trained_s) == (288.0, 256.0)
    assert (d.engines, d.concurrency, d.accelerators_per_engine, d.group) == (26, 256, 2, GROUP)


def test_the_simulator_gives_a_demand_for_each_model_and_policy():
    demands = simulated_demand(steps=2, sizes=(64,))
    assert [(d.model, d.accelerators) for d in demands] == [("7B", 64)] * 2 + [("32B", 64)] * 2
    for d in demands:
        assert d.samples_s >= d.trained_s > 0 and d.engines > 0 and d.concurrency > 0


@pytest.mark.parametrize(
    ("ceiling", "demand", "expected"),
    [(900.0, 300.0, 3.0), (100.0, 400.0, 0.25), (5.0, 0.0, math.inf)],
    ids=["three-times", "a-quarter", "no-demand"],
)
def test_headroom_is_ceiling_over_demand(ceiling, demand, expected):
    assert headroom(ceiling, demand) == expected


def test_headroom_refuses_negative_rates():
    with pytest.raises(ValueError, match=">= 0"):
        headroom(-1.0, 1.0)


def test_projection_scales_to_the_busiest_controller_having_a_core():
    assert projected(1000.0, [0.25, 0.5, 0.1]) == 2000.0
    assert projected(1000.0, [0.0]) == math.inf


COSTS = Costs(
    store_per_sample=0.001, call=0.0005, report=0.001, relay_per_check=0.0002,
    take={(418, 4): 0.05},
)  # fmt: skip


def test_costs_turn_demand_into_busy_cores():
    assert COSTS.store(SEVEN_B) == pytest.approx(0.64)  # 640 samples/s x 1 ms
    # 10 takes/s x (50 ms of work + 0.5 ms a call) + 100 reports/s x 1 ms + 418 x 1/16
    # held takes/s x 0.5 ms
    assert COSTS.dispatcher(SEVEN_B) == pytest.approx(0.505 + 0.1 + 418 / 16 * 0.0005)
    assert COSTS.relay(SEVEN_B) == pytest.approx(80 * 0.0002)  # a node's 8 engines
    assert COSTS.one_relay(SEVEN_B) == pytest.approx(4180 * 0.0002)


def test_the_verdict_names_the_controllers_short_of_three_times_the_largest_demand():
    small = Demand("7B", 64, "p", 26, 256, 40.0, 30.0, group=16)
    text = verdict(Ceiling(1950.0, []), [small, SEVEN_B], COSTS)
    # At 1024: measured 1950 / 640 = 3.0x; store 1 / 0.64; dispatcher 1 / 0.618; a node's
    # relay 1 / 0.016.
    assert "end to end on these 2 cores 3.0x" in text
    assert "the store, projected 1.6x" in text
    assert "the dispatcher (takes, reports, held takes) 1.6x" in text
    assert "a node's relay (weights.relays: per_node) 62.5x" in text
    assert text.endswith(
        "Below 3x: the store, projected, the dispatcher (takes, reports, held takes)."
    )


def _level(workers: int, offered: float, acked: float, store_cpu: float = 0.2) -> LevelResult:
    return LevelResult(
        workers=workers, offered=offered, window_s=5.0, acked_s=acked, rates={}, latency={},
        lease_waited=False, cpu={"store": store_cpu, "dispatcher": 0.1, "relay": 0.05},
        others_cpu={}, groups_per_step=8, max_staleness=3, stale=0, stop_s=1.0,
        loaded=(1.0, 2 * workers), ledger={}, violations=[],
    )  # fmt: skip


def test_a_ceiling_that_kept_up_shows_no_saturation():
    ceiling = find_ceiling([_level(64, 1000, 990), _level(256, 2000, 1950)])
    assert ceiling.samples_s == 1950 and ceiling.saturated == []


@pytest.mark.parametrize(
    ("levels", "sign"),
    [
        ([_level(64, 1000, 990), _level(256, 2000, 1200)], "256 workers carried 60%"),
        ([_level(64, 1000, 990), _level(256, 2000, 1000)], "1.01x the level before"),
        ([_level(64, 1000, 990, store_cpu=0.95)], "the store used 95% of a core"),
    ],
    ids=["short-of-offered", "stopped-growing", "controller-busy"],
)
def test_saturation_is_named(levels, sign):
    assert any(sign in s for s in find_ceiling(levels).saturated)


def test_a_profile_counts_each_function_once_per_stack_over_its_threads_samples(tmp_path):
    root = tmp_path / "repo"
    ours = f"{root}/storage/trajectory_store.py"
    lines = [
        f"thread (1): loop;run (/x/.venv/lib/ray/worker.py:1);put ({ours}:10);add ({ours}:20) 30",
        f"thread (1): loop;run (/x/.venv/lib/ray/worker.py:1);put ({ours}:10) 10",
        "thread (1): loop;select (/usr/lib/python3.11/selectors.py:468) 60",
        f"thread (2): other;put ({ours}:10);put ({ours}:11) 40",  # recursion counts once
        "thread (2): other;idle (/usr/lib/python3.11/threading.py:1) 60",
        "not a profile line",
    ]
    frames = dict(top_frames(lines, root))
    assert frames == {
        "put (storage/trajectory_store.py)": 0.4,  # thread 1: 40 of 100, thread 2: 40 of 100
        "add (storage/trajectory_store.py)": 0.3,
    }


def test_levels_parse_and_bad_ones_name_the_format():
    assert parse_levels("64:1000 256:2000.5") == [(64, 1000.0), (256, 2000.5)]
    for bad in ("64", "0:100", "64:-1", "x:100"):
        with pytest.raises(Exception, match="workers:samples_per_s"):
            parse_levels(bad)


def test_a_level_sizes_its_steps_generation_and_bound_from_the_offered_rate():
    load = Load(workers=512, offered=4096.0, group=16, slots=2, weight_check_s=1.0)
    assert load.running == 24  # room for 32 samples, filled a group of 16 at a time
    assert load.generation_s == 3.0  # a sample: 512 x 24 samples running at 4096/s
    assert load.groups_per_step == 256  # 4096 samples a second / 16
    # Admission: up to 4 x 1024 groups part-done / 256 a step = 16; staleness: a group of
    # (4 x 3 s) and a weight check (1 s) span 13 steps of 1 s.
    assert load.max_staleness == 17


def test_a_clock_engine_finishes_requests_at_their_drawn_lengths_and_hurries_at_the_end():
    load = Load(workers=1, offered=8_000.0, slots=1)  # samples of 1 ms: due at once
    hurry = threading.Event()
    engine = ClockEngine(load, length_pool(), seed=0, hurry=hurry)
    for j in range(GROUP):
        engine.start(f"g/{j}", engine.prompt_ids(["x"])[0], MAX_NEW_TOKENS, 1.0, j)
    done: list[Delta] = []
    while len(done) < GROUP:
        done += engine.step()
    assert sorted(d.request_id for d in done) == sorted(f"g/{j}" for j in range(GROUP))
    lengths = [len(d.token_ids) for d in done]
    assert all(d.finished and len(d.logprobs) == len(d.token_ids) for d in done)
    assert set(lengths) <= set(engine.lengths.tolist())  # the 7B workload's lengths
    groups = engine.generate(["a", "b"], 3, MAX_NEW_TOKENS, 1.0, seed=0)
    assert [len(g) for g in groups] == [3, 3]
    assert all(c.text == ("odd" if len(c.token_ids) % 2 else "even") for g in groups for c in g)
    assert 1_000 < float(np.mean(engine.lengths)) < 10_000  # long-tail responses, ~4k mean

    slow = ClockEngine(Load(workers=128, offered=1.0, slots=1), length_pool(), 1, hurry)
    slow.warm = 0  # samples of 1,024 s on average
    slow.start("late/0", [1], MAX_NEW_TOKENS, 1.0, 0)
    slow.start("late/1", [1], MAX_NEW_TOKENS, 1.0, 1)
    slow.abort(["late/1"])
    assert slow.generated("late/0") == 0 and slow.generated("late/1") is None
    hurry.set()  # the level ends: what runs finishes at the next step, the aborted one not
    assert [d.request_id for d in slow.step()] == ["late/0"]


def test_a_take_at_a_small_shape_costs_the_real_dispatcher_something():
    assert 0.0 < take_cost(engines=4, want=2, groups_per_step=8, takes=3) < 1.0


def test_a_small_level_runs_the_real_controllers_and_the_ledger_is_exactly_once(
    ray_local, tmp_path
):
    hosts = [WorkerHost.remote(seed) for seed in range(HOSTS)]
    try:
        result = run_level(
            Load(workers=8, offered=160.0), hosts, tmp_path / "level", window_s=2.0,
            step_s=0.0, profile=False,
        )  # fmt: skip
    finally:
        for host in hosts:
            ray_local.kill(host)
    assert result.violations == []
    ledger = result.ledger
    assert ledger["dispatched"] == ledger["trained"] + ledger["dropped"] > 0
    assert ledger["trained"] > 0 and result.rates["takes"] > 0
    assert set(result.cpu) == {"store", "dispatcher", "relay"}


def test_a_take_costs_the_same_path_with_its_events_sent_to_a_real_store(ray_local, tmp_path):
    (shape,) = take_costs([(4, 2)], tmp_path).items()
    assert shape[0] == (4, 2) and 0.0 < shape[1] < 1.0


def test_the_ramp_runs_at_the_largest_demands_engines_from_its_rate_up():
    small = Demand("7B", 64, "p", 26, 256, 40.0, 30.0, group=16)
    busy = Demand("7B", 1024, "k=16", 418, 256, 482.0, 480.0, group=16)
    calm = Demand("7B", 1024, "k=2", 418, 256, 190.0, 190.0, group=16)
    assert largest_demand([small, calm, busy]) is busy
    plan = ramp_levels(busy, window_s=15.0)
    assert [(load.workers, load.offered, window) for load, window in plan] == [
        (418, 482.0, 60.0),  # the demand itself, held a minute
        (418, 964.0, 15.0),
        (418, 1446.0, 15.0),
        (418, 1928.0, 15.0),
    ]


def _ramp_level(offered: float, acked: float, window: float = 15.0) -> LevelResult:
    return replace(
        _level(418, offered, acked),
        window_s=window,
        latency={"take": summarise([0.01, 0.02])},
        ledger={"dispatched": 10, "trained": 8, "dropped": 2},
    )


def test_the_ramp_says_where_it_saturated_and_against_three_times_the_demand():
    busy = Demand("7B", 1024, "k=16", 418, 256, 500.0, 500.0, group=16)
    ramp = [_ramp_level(500, 495, 60.0), _ramp_level(1000, 990), _ramp_level(1500, 1200)]
    text = ramp_text(busy, ramp)
    assert "held 60 s: 495 samples/s acknowledged (99% of the offered rate)" in text
    assert text.endswith(
        "It saturates at 3x: offered 1,500, it carried 1,200 (80%); the most any step "
        "carried was 1,200 samples/s, 2.4x the demand, below 3x."
    )
    kept_up = ramp_text(busy, ramp[:2])
    assert kept_up.endswith("up to 990 samples/s (2.0x the demand): saturation lies above.")


def _measured_level(workers: int, offered: float, acked: float, **changes) -> LevelResult:
    """A level as run_level returns it: every rate and latency the section's table shows."""
    return replace(
        _level(workers, offered, acked),
        rates={"groups": 59.2, "takes": 58.7, "empty takes": 0.4, "puts": 49.0,
               "reports": 93.0, "checks": 60.0},
        latency={"take": summarise([0.01, 0.03]), "put": summarise([0.05]),
                 "lease": summarise([0.04, 0.04]), "ack": summarise([0.06, 0.11]),
                 "check": summarise([0.005, 0.05])},
        others_cpu={"workers": 0.87, "driver (trainer)": 0.03, "machine": 1.76},
        loaded=(0.4, 2 * workers),
        ledger={"dispatched": 100, "trained": 90, "dropped": 10, "open": 0},
        **changes,
    )  # fmt: skip


def _measurement() -> Measurement:
    """A quick run's measurement: two levels, a ramp step at SEVEN_B's demand, the four
    probes, two simulated cells, their take costs."""
    small = Demand("7B", 64, "p", 26, 256, 40.0, 30.0, group=16)
    profile = {"store": [("put (storage/trajectory_store.py)", 0.41)]}
    return Measurement(
        levels=[
            _measured_level(64, 1000.0, 990.0),
            # the best: 0.39 CPU over 1,950 samples/s, 0.2 ms a sample in the store
            _measured_level(256, 2000.0, 1950.0, cpu={"store": 0.39, "dispatcher": 0.1,
                                                      "relay": 0.05}, profile=profile),
        ],
        ramp=[_measured_level(418, 640.0, 630.0, window_s=60.0)],
        probes=[
            ProbeResult("relay: anything newer?", 64, 5000.0, summarise([0.001]), 0.5),
            ProbeResult("dispatcher: take, admission holds it back", 64, 2000.0,
                        summarise([0.002]), 0.6),
            ProbeResult("dispatcher: report", 64, 1000.0, summarise([0.003]), 0.4),
            ProbeResult("dispatcher: take of one group", 64, 500.0, summarise([0.01]), 0.9),
        ],
        demands=[small, SEVEN_B],
        takes={(26, 4): 0.01, (418, 4): 0.05},
        args={"levels": [[64, 1000.0], [256, 2000.0]], "window": 4.0, "step_s": 0.5,
              "probe_callers": 64, "probe_s": 2.0, "sim_steps": 6, "quick": True,
              "no_profile": True},
        setup={**setup(), "hosts": 3},  # not HOSTS: the section states what was recorded
        elapsed_s=54.6,
        load_average=(0.3, 12.5),
    )  # fmt: skip


def test_a_measurement_reads_back_from_its_json_as_it_was():
    measurement = _measurement()
    data = json.loads(json.dumps(measurement.to_dict(), allow_nan=False))
    again = Measurement.from_dict(data)
    assert again == measurement
    assert again.levels[1].profile["store"] == [("put (storage/trajectory_store.py)", 0.41)]
    assert again.levels[0].loaded == (0.4, 128) and again.takes[418, 4] == 0.05


def test_no_latencies_are_kept_as_nulls_and_read_back_as_empty():
    empty = summarise([])
    assert empty.to_dict() == {"count": 0, "p50": None, "p99": None}
    again = Latency.from_dict(json.loads(json.dumps(empty.to_dict(), allow_nan=False)))
    assert again.count == 0 and math.isnan(again.p99) and again.ms() == "-"


def test_the_section_is_rendered_from_the_record_alone():
    measured = Record.measured(
        "control-plane", "Control plane under load", render, _measurement().to_dict(),
        ["ray", "pyarrow"], command=".venv/bin/python -m benchmarks.control_plane --quick",
    )  # fmt: skip
    record = replace(measured, commit="abc1234", date="2026-11-30 17:40 UTC")
    assert record.render == "benchmarks.control_plane:render"
    lines = record.text().splitlines()
    assert lines[0].startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert ", ray " in lines[0] and ", pyarrow " in lines[0]
    assert lines[0].endswith("; load average 0.3 before, 12.5 after; 55 s in all.")
    assert lines[1] == "Command: `.venv/bin/python -m benchmarks.control_plane --quick`."
    text = "\n".join(lines)
    # the recorded settings and arguments, not this code's
    assert "in 3 processes, room for 32 samples each" in text
    assert "trains 0.5 s a step" in text and "6 steps a cell" in text
    assert "Each level is measured for 5 s after a warm-up." in text
    assert "| 256 | 2,000 | 1,950 | 59 | 59 (0) | 49 | 93 | 10.0 / 30.0 |" in text
    assert "| 1x | 60 | 418 | 640 | 630 |" in text  # the ramp, at SEVEN_B's 640 samples/s
    # the costs derived from the best level and the probes
    assert (
        "0.20 ms a sample in the store, 0.30 ms a held take, 0.40 ms a report, 0.10 ms a "
        "relay check" in text
    )
    # At 1024: 1,950 / 640 end to end; the store 640 x 0.2 ms; a take 50 ms; the dispatcher
    # 10 takes/s x 50.3 ms + 100 reports/s x 0.4 ms + 26.1 held takes/s x 0.3 ms.
    assert "| 7B x1024 | 640 | 3.0x | 0.13 (7.8x) | 50.0 | 10.0, 100, 26.1 | 0.55 (1.8x) |" in text
    assert text.endswith(
        "store, 256 workers (py-spy, share of a thread's wall time): "
        "put (storage/trajectory_store.py) 41%"
    )
