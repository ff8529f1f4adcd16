"""Learning curves of a config: held-out accuracy against RL steps, per mode and seed.

Runs ``sluice run CONFIG`` once per variant and seed and keeps one record per run (the
held-out curve and the seconds of RL each evaluation came after, staleness counts,
throughput, the commit, machine and command). For the default config the variants are
``async`` with ``stale_by`` last_token and first_token, and ``one_step``, each seed with its
own warm-started policy, the records under ``benchmarks/results/learning/``; for another
config (``--config configs/smollm2.yaml``) the variant is the config as it is, the records
under ``benchmarks/results/<config's name>/``. A run whose record already names the
measured commit is not run again, so a grid (nine runs of ~30 minutes here) can be
measured in several sittings. ``--write`` puts the table of medians and ranges over the
seeds into docs/results.md (or ``--doc``) between markers (``learning-curves-<steps>``, or
``<config's name>-curves-<steps>``).

    .venv/bin/python -m benchmarks.learning --steps 1600 --seeds 0 1 2 --write
    .venv/bin/python -m benchmarks.learning --config configs/smollm2.yaml --steps 60 --write
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.records import machine
from benchmarks.report import measured_commit, uncommitted
from benchmarks.tables import markdown_table, span, spread

ROOT = Path(__file__).parents[1]
CONFIG = "configs/default.yaml"
RECORDS = ROOT / "benchmarks" / "results" / "learning"
RESULTS_DOC = ROOT / "docs" / "results.md"
MARKER = "learning-curves"  # docs/results.md: one table per run length, learning-curves-<steps>
# (label, overrides): the default first.
VARIANTS: dict[str, list[str]] = {
    "async, stale_by last_token": ["mode=async", "stale_by=last_token"],
    "async, stale_by first_token": ["mode=async", "stale_by=first_token"],
    "one_step": ["mode=one_step"],
    "as configured": [],
    # The algorithms of docs/algorithms.md, each beside the default (async, last_token,
    # GRPO with PPO's clip): `make bench-learning-algorithms`.
    "Dr. GRPO": ["mode=async", "train.scale_adv_by_std=false", "train.loss_agg=seq_mean_token_sum"],
    "DAPO": [
        "mode=async", "train.clip_eps_high=0.28", "train.dynamic_sampling=true",
        "train.overlong_buffer=8",
    ],
    "GSPO": [
        "mode=async", "train.loss=gspo", "train.loss_agg=seq_mean_token_mean",
        "train.clip_eps=0.0003", "train.clip_eps_high=0.0004",
    ],
    "RLOO": ["mode=async", "train.advantage=rloo"],
    "REINFORCE++": ["mode=async", "train.advantage=reinforce_pp"],
    "REINFORCE++-baseline": ["mode=async", "train.advantage=reinforce_pp_baseline"],
    "KL k3 0.01": ["mode=async", "train.kl_coef=0.01"],
    "PPO with a critic": ["mode=async", "train.critic={}"],
}  # fmt: skip
DEFAULT_VARIANTS = list(VARIANTS)[:3]
"""What the default config's grid runs; another config's runs "as configured"."""


def records_dir(config: str) -> Path:
    return RECORDS if config == CONFIG else RECORDS.parent / Path(config).stem


def marker(config: str, steps: int) -> str:
    return f"{MARKER if config == CONFIG else Path(config).stem + '-curves'}-{steps}"


def slug(label: str, seed: int) -> str:
    return "".join(c if c.isalnum() else "-" for c in label).strip("-") + f"-s{seed}"


def record_path(
    label: str, seed: int, steps: int, config: str = CONFIG, train_seed: int | None = None
) -> Path:
    """One record per variant, seed and length: a 400-step run does not replace a 1,600.
    A run with its own ``train_seed`` (the same starting policy, other training prompts) is
    kept under ``draws/``, beside the grid's table, not in it."""
    if train_seed is None:
        return records_dir(config) / f"{slug(label, seed)}-{steps}steps.json"
    return records_dir(config) / "draws" / f"{slug(label, seed)}-t{train_seed}-{steps}steps.json"


def _series(
    db: sqlite3.Connection, run_id: str, key: str, column: str = "value"
) -> dict[int, float]:
    rows = db.execute(
        f"SELECT step, {column} FROM metrics WHERE run_uuid = ? AND key = ? ORDER BY step",
        (run_id, key),
    ).fetchall()
    return {int(step): float(value) for step, value in rows}


def rl_seconds(logged_ms: dict[int, float], eval_s: dict[int, float]) -> dict[int, float]:
    """Seconds of RL before each evaluation: its logging time since step 0's, less the
    evaluations' own seconds up to it (``eval/seconds``; step 0's is before the clock)."""
    start = logged_ms[min(logged_ms)]
    out = {}
    for step, ms in sorted(logged_ms.items()):
        evaluating = sum(s for at, s in eval_s.items() if 0 < at <= step)
        out[step] = round((ms - start) / 1000 - evaluating, 1)
    return out


def run_one(
    label: str,
    seed: int,
    steps: int,
    root: Path,
    commit: str,
    config: str = CONFIG,
    train_seed: int | None = None,
) -> dict:
    """Run one variant and seed of ``config`` at ``commit`` (the checkout's); its record.
    ``train_seed``: draw the training prompts by it (``env.train_seed``), not by ``seed``."""
    name = slug(label, seed) + ("" if train_seed is None else f"-t{train_seed}")
    settings = [*VARIANTS[label], f"seed={seed}", f"train.steps={steps}", f"name={name}"]
    if train_seed is not None:
        settings.append(f"env.train_seed={train_seed}")
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", config]
    for setting in [*settings, f"root={root}"]:
        cmd += ["--set", setting]
    print(f"running {label}, seed {seed}, {steps} steps ...", flush=True)
    start = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - start
    run_dir = root / name
    summary = json.loads((run_dir / "summary.json").read_text())
    with sqlite3.connect(root / "mlflow.db") as db:
        run_id = summary["mlflow_run_id"]
        curve = _series(db, run_id, "eval/accuracy")
        logged = _series(db, run_id, "eval/accuracy", "timestamp")
        eval_s = _series(db, run_id, "eval/seconds")
        staleness = {
            key.rsplit("/", 1)[1]: sum(_series(db, run_id, key).values())
            for (key,) in db.execute(
                "SELECT DISTINCT key FROM metrics WHERE run_uuid = ? AND key LIKE "
                "'train/staleness_count/%'",
                (run_id,),
            )
        }
        entropy = _series(db, run_id, "train/entropy")
    computer = machine()
    return {
        "config": config,
        "variant": label,
        "seed": seed,
        **({} if train_seed is None else {"train_seed": train_seed}),
        "steps": steps,
        "heldout": {str(k): v for k, v in sorted(curve.items())},
        "rl_seconds": {str(k): v for k, v in rl_seconds(logged, eval_s).items()},
        "entropy_first_last": [entropy[min(entropy)], entropy[max(entropy)]],
        "staleness_counts": staleness,
        "samples_per_s": summary["samples_per_s"],
        "wall_s": round(wall, 1),
        "collapse": summary.get("collapse", []),
        "commit": commit,
        "date": f"{datetime.now(UTC):%Y-%m-%d}",
        "machine": f"{computer['cpu']}, {computer['arch']}",
        "command": "sluice run " + config + "".join(f" --set {s}" for s in settings),
        **({"pythonpath": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}),
    }


def load_records(config: str = CONFIG) -> list[dict]:
    """The kept records of ``config``'s runs (a folder's other JSON files left out)."""
    found = [json.loads(p.read_text()) for p in sorted(records_dir(config).glob("*.json"))]
    return [r for r in found if "variant" in r and r.get("config", CONFIG) == config]


def quotes(folder: str, steps: int) -> dict[str, str] | None:
    """What docs may quote of the ``steps``-step runs kept in ``benchmarks/results/<folder>/``
    (``benchmarks/quotes.py``), per variant (``async--stale-by-last-token``): the seeds and
    their commits, the held-out accuracy at the start and the end and the gain in points,
    as median (min-max) over the seeds (the gain also as its median alone and its range)
    and per seed (``.s0.gain``), each seed's commit, trained samples/s, wall seconds,
    minutes of RL and held-out accuracy at each evaluation (``.s0.at20``), the range of
    the seeds' samples/s; over every run, the lowest and the highest gain and whose they
    are; None without records."""
    found = [json.loads(p.read_text()) for p in sorted((RECORDS.parent / folder).glob("*.json"))]
    runs = [r for r in found if "variant" in r and r["steps"] == steps]
    if not runs:
        return None
    out = {"commits": ", ".join(sorted({r["commit"] for r in runs}))}
    gains = sorted(
        ((100 * (r["heldout"][str(steps)] - r["heldout"]["0"]), r) for r in runs),
        key=lambda g: g[0],
    )
    for end, (gain, run) in (("lowest", gains[0]), ("highest", gains[-1])):
        out[f"{end}-gain"] = f"{gain:+.1f}"
        out[f"{end}-gain.of"] = f"{run['variant']}, seed {run['seed']}"
    for label in VARIANTS:
        mine = sorted((r for r in runs if r["variant"] == label), key=lambda r: r["seed"])
        if not mine:
            continue
        key = slug(label, 0).removesuffix("-s0")
        first = [100 * r["heldout"]["0"] for r in mine]
        last = [100 * r["heldout"][str(steps)] for r in mine]
        gains = [b - a for a, b in zip(first, last, strict=True)]
        out |= {
            f"{key}.seeds": str(len(mine)),
            f"{key}.commits": ", ".join(sorted({r["commit"] for r in mine})),
            f"{key}.start": spread(first, "%", 1),
            f"{key}.end": spread(last, "%", 1),
            f"{key}.gain": _signed(gains),
            f"{key}.median-gain": f"{statistics.median(gains):+.1f}",
            f"{key}.gain-range": f"{min(gains):+.1f} to {max(gains):+.1f}",
            f"{key}.samples-per-s-range": span([r["samples_per_s"] for r in mine], "", 0),
        }
        for r, a, b in zip(mine, first, last, strict=True):
            at = f"{key}.s{r['seed']}"
            out |= {
                f"{at}.start": f"{a:.1f}%",
                f"{at}.end": f"{b:.1f}%",
                f"{at}.gain": f"{b - a:+.1f}",
                f"{at}.commit": r["commit"],
                f"{at}.samples-per-s": f"{r['samples_per_s']:.0f}",
                f"{at}.wall-s": f"{r['wall_s']:,.0f}",
            }
            if str(steps) in r.get("rl_seconds", {}):
                out[f"{at}.minutes"] = f"{r['rl_seconds'][str(steps)] / 60:.0f}"
            for step, accuracy in r["heldout"].items():
                out[f"{at}.at{step}"] = f"{100 * accuracy:.1f}%"
    return out


def _signed(values: list[float]) -> str:
    """``+31.2 (+23.8 to +34.0)``: the median and range of signed values, or the one value."""
    mid = f"{statistics.median(values):+.1f}"
    return mid if len(values) == 1 else f"{mid} ({min(values):+.1f} to {max(values):+.1f})"


def _cell(values: list[float], unit: str, digits: int) -> str:
    return spread(values, unit, digits) if values else "-"


def table(records: list[dict], steps: int, config: str = CONFIG) -> str:
    """Median (min-max) held-out accuracy over the seeds per variant: every eighth of the
    run, or at every evaluation in a run of 100 steps or fewer, with the minutes of RL
    before it where the records have them."""
    records = [r for r in records if r["steps"] == steps]
    if steps <= 100:
        marks = sorted({int(k) for r in records for k in r["heldout"]})
    else:
        marks = list(range(0, steps + 1, max(steps // 8, 1)))
    rows = []
    for label in VARIANTS:
        runs = [r for r in records if r["variant"] == label]
        if not runs:
            continue
        seeds = f"{len(runs)} seed{'s' if len(runs) > 1 else ''}"
        accuracy = [f"{label} ({seeds})"]
        minutes = [f"{label}: minutes of RL"]
        for mark in marks:
            at = str(mark)
            accuracy.append(
                _cell([100 * r["heldout"][at] for r in runs if at in r["heldout"]], "%", 1)
            )
            timed = [r["rl_seconds"][at] / 60 for r in runs if at in r.get("rl_seconds", {})]
            minutes.append(_cell(timed, "", 0))
        rows.append(accuracy)
        if any(cell != "-" for cell in minutes[1:]):
            rows.append(minutes)
    commits = sorted({r["commit"] for r in records})
    machines = sorted({r["machine"] for r in records})
    folder = records_dir(config).relative_to(ROOT)
    which = "" if config == CONFIG else f"--config {config} "
    paths = sorted({r["pythonpath"] for r in records if "pythonpath" in r})  # an example's code
    env = "".join(f"PYTHONPATH={p} " for p in paths[:1])
    lines = [
        f"Records: `{folder}/` (commit {', '.join(commits)}; {'; '.join(machines)}).",
        f"Command: `{env}.venv/bin/python -m benchmarks.learning {which}--steps {steps} "
        "--seeds 0 1 2`.",
        "",
        *markdown_table(["variant", *(str(m) for m in marks)], rows),
    ]
    return "\n".join(lines)


def write_doc(body: str, name: str, doc: Path = RESULTS_DOC) -> None:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = doc.read_text()
    if begin not in text:
        raise SystemExit(f"{doc} has no {begin} marker")
    head, rest = text.split(begin, 1)
    doc.write_text(head + f"{begin}\n{body}\n{end}" + rest.split(end, 1)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--config", default=CONFIG, help="the config to run (default: %(default)s)")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        help=f"default: {', '.join(DEFAULT_VARIANTS)} for {CONFIG}, else as configured",
    )
    parser.add_argument(
        "--train-seed",
        type=int,
        help="draw the training prompts by this seed (same starting policy); kept under draws/",
    )
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "bench-learning")
    parser.add_argument("--write", action="store_true", help="write the table into --doc")
    parser.add_argument(
        "--doc",
        type=Path,
        default=RESULTS_DOC.relative_to(ROOT),
        help="the page whose markers take the table (default: %(default)s)",
    )
    parser.add_argument(
        "--table-only", action="store_true", help="run nothing: the table of the kept records"
    )
    args = parser.parse_args()
    changed = [] if args.table_only else uncommitted()
    if changed:  # a record names the commit it measured: that must be the code that ran
        raise SystemExit(f"commit these first, the records name a commit: {', '.join(changed)}")
    variants = args.variants or (DEFAULT_VARIANTS if args.config == CONFIG else ["as configured"])
    if args.train_seed is not None and args.write:
        raise SystemExit("--write writes the grid's table; draws (--train-seed) are not in it")
    commit = measured_commit()
    for seed in [] if args.table_only else args.seeds:  # a seed's variants side by side
        for label in variants:
            path = record_path(label, seed, args.steps, args.config, args.train_seed)
            if path.exists():
                old = json.loads(path.read_text())
                if old["commit"] == commit and old["steps"] == args.steps:
                    print(f"{label}, seed {seed}: already measured at {commit}")
                    continue
            root = args.root / commit / Path(args.config).stem  # run names repeat by config
            record = run_one(label, seed, args.steps, root, commit, args.config, args.train_seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record, indent=1) + "\n")
    body = table(load_records(args.config), args.steps, args.config)
    print(body)
    if args.write:
        write_doc(body, marker(args.config, args.steps), ROOT / args.doc)


if __name__ == "__main__":
    main()
