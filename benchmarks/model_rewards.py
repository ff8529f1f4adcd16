"""Rewards from models: what a judge and a reward model cost, each served in a Ray actor of
its own (one CPU slot) beside the rollout worker and the trainer, in one invocation.

- serving: SmolLM2-135M-Instruct as the judge of ``configs/judge.yaml``, and as a reward
  model (its backbone under a fresh one-label head, saved here as a sequence-classification
  folder), scoring groups of 8 completions of held-out problems (4 right, 4 wrong) through
  the rollout worker's ``ModelScorer``: scored samples per second over ``--rounds``
  interleaved rounds, and the judge's agreement with the exact answer;
- in a run: ``configs/judge.yaml`` for ``--steps`` async steps scored by the judge, by the
  reward model, and by the environment's verifier, ``--repeats`` runs of each, alternating:
  trained samples/s over the steps' wall clock, and the share of the steps' time the served
  model computed (``rollout/reward/model_s`` times the samples it scored, over the steps'
  seconds).

Prints the section; ``--write`` also keeps the record (``benchmarks/records.py``) and puts
the section in BENCHMARKS.md ("Rewards from models").

    .venv/bin/python -m benchmarks.model_rewards --write
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.records import Record, publish, run_record
from benchmarks.series import _metrics
from benchmarks.tables import markdown_table, spread
from sluice.config.tree import JudgeConfig, RewardModelConfig, load_config
from sluice.engines.reward_models.scorer import MODEL_SECONDS, ModelScorer
from sluice.engines.reward_models.served import launch_served

ROOT = Path(__file__).parents[1]
CONFIG = "configs/judge.yaml"
GROUP = 8


def reward_model_folder(judge: Path, into: Path) -> Path:
    """``judge``'s backbone under a fresh one-label head, as a sequence-classification
    folder (safetensors): a reward model of the judge's size."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        judge, num_labels=1, use_safetensors=True, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(judge)
    model.config.pad_token_id = tokenizer.pad_token_id or tokenizer.eos_token_id
    model.save_pretrained(into, safe_serialization=True)
    tokenizer.save_pretrained(into)
    return into


def groups(n: int) -> tuple[list[Any], list[list[str]]]:
    """``n`` held-out problems of the config's task, each with 4 right and 4 wrong answers."""
    from sluice.envs import make_env

    cfg = load_config(ROOT / CONFIG)
    env = make_env(cfg.env.name, digits=cfg.env.digits)
    problems = env.problems("heldout", n, 1)
    wrong = [str(int(p.answer) + 1 + int(p.answer) % 9) for p in problems]
    return problems, [[p.answer] * 4 + [w] * 4 for p, w in zip(problems, wrong, strict=True)]


def serving(
    served_cfgs: dict[str, JudgeConfig | RewardModelConfig], rounds: int
) -> dict[str, dict[str, list[float]]]:
    """Per model, each round's scored samples per second and (the judge) agreement."""
    import ray

    from sluice.engines.cluster.ray_cluster import child_env
    from sluice.envs import make_env

    cfg = load_config(ROOT / CONFIG)
    env = make_env(cfg.env.name, digits=cfg.env.digits)
    problems, completions = groups(16)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    out: dict[str, dict[str, list[float]]] = {}
    try:
        scorers = {}
        for label, served_cfg in served_cfgs.items():
            served = launch_served(served_cfg, 0, child_env())
            served.wait_loaded()
            scorers[label] = ModelScorer(served, verifier=env, owned=True)
            out[label] = {"samples_per_s": [], "agreement": []}
        for scorer in scorers.values():  # a warm-up round each
            scorer.score(problems[:1], completions[:1], [[1] * GROUP])
        for r in range(rounds):
            for label, scorer in scorers.items():
                start = time.perf_counter()
                results = [
                    scorer.score([p], [c], [[1] * GROUP])[0]
                    for p, c in zip(problems, completions, strict=True)
                ]
                seconds = time.perf_counter() - start
                flat = [x for g in results for x in g]
                assert all(x.error is None for x in flat), [x.error for x in flat if x.error]
                out[label]["samples_per_s"].append(len(flat) / seconds)
                agree = [x.metrics["agrees_with_verifier"] for x in flat]
                out[label]["agreement"].append(sum(agree) / len(agree))
                print(f"round {r + 1}: {label} {len(flat) / seconds:.1f} samples/s", flush=True)
        for scorer in scorers.values():
            scorer.close()
    finally:
        ray.shutdown()
    return out


def run(label: str, settings: list[str], steps: int, root: Path, repeat: int) -> dict[str, Any]:
    """One run of ``configs/judge.yaml`` scored as ``label`` says: the run's record and
    the seconds the served model computed in its steps."""
    name = f"bench-{label.split()[0]}-{repeat}"
    cmd = [sys.executable, "-m", "sluice.flows.cli", "run", CONFIG]
    for setting in (*settings, f"train.steps={steps}", f"eval.every={steps}", f"name={name}",
                    f"root={root}"):  # fmt: skip
        cmd += ["--set", setting]
    print(f"running {label} ({repeat + 1}) for {steps} steps ...", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((root / name / "summary.json").read_text())
    metrics = _metrics(root / "mlflow.db", summary["mlflow_run_id"])
    per_sample = metrics.get(f"rollout/reward/{MODEL_SECONDS}", {})
    scored = metrics.get("rollout/groups", {})
    model_s = sum(per_sample[s] * scored.get(s, 0.0) * GROUP for s in per_sample)
    return {"run": run_record(root / name, root), "model_s": model_s}


def rate(record: dict[str, Any]) -> float:
    """Trained samples over the steps' wall clock (the benchmarks' one clock)."""
    steps = record["run"]["steps"]
    return sum(s["samples"] for s in steps) / sum(s["wall_s"] for s in steps)


def share(record: dict[str, Any]) -> float:
    return record["model_s"] / sum(s["wall_s"] for s in record["run"]["steps"])


def render(record: Record) -> str:
    """The section: the serving table (samples/s and agreement per model), then the runs
    (trained samples/s, its ratio to the verifier's, the served model's share of the steps'
    time), each as median (min-max) over the rounds or runs."""
    data = record.data
    serve_rows = [
        [label, spread(v["samples_per_s"], ""),
         spread([100 * a for a in v["agreement"]], "%", 0) if label == "judge" else "-"]
        for label, v in data["serving"].items()
    ]  # fmt: skip
    runs = data["runs"]
    base = statistics.median(rate(r) for r in runs["verifier"])
    run_rows = [
        [label, spread([rate(r) for r in records], ""),
         f"{statistics.median(rate(r) for r in records) / base:.2f}",
         spread([100 * share(r) for r in records], "%", 0) if label != "verifier" else "-"]
        for label, records in runs.items()
    ]  # fmt: skip
    return "\n".join(
        [
            f"{record.measured_on()}; `{record.command}`. SmolLM2-135M-Instruct as the judge "
            f"of `{CONFIG}` and, under a fresh one-label head, as a reward model; each in one "
            "Ray actor with one CPU slot. Serving: groups of 8 answers (4 right, 4 wrong) of "
            f"16 held-out problems, {data['rounds']} interleaved rounds; agreement: the "
            "share of answers the judge's verdict calls as the exact answer does.",
            "",
            *markdown_table(["served model", "samples scored/s", "agreement"], serve_rows),
            "",
            f"In a run: `{CONFIG}` for {data['steps']} async steps, {data['repeats']} runs of "
            "each scoring, alternating; trained samples/s over the steps' wall clock; share: "
            "the seconds the served model computed over the steps' seconds.",
            "",
            *markdown_table(
                ["scored by", "trained samples/s", "ratio", "share of the steps"], run_rows
            ),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--write", action="store_true", help="keep the record, update BENCHMARKS.md"
    )
    args = parser.parse_args()
    judge = load_config(ROOT / CONFIG).reward.judge
    assert judge is not None
    folder = ROOT / judge.model
    if not folder.is_dir():
        sys.exit(f"{folder} is missing: `make model` writes it")
    with tempfile.TemporaryDirectory(prefix="sluice-bench-model-rewards-") as tmp:
        rm = reward_model_folder(folder, Path(tmp) / "reward-model")
        serve = serving({"judge": judge, "reward model": RewardModelConfig(model=str(rm))},
                        args.rounds)  # fmt: skip
        paths = {
            "judge": [],
            "reward model": ["reward.judge=null", f"reward.model.model={rm}"],
            "verifier": ["reward.judge=null"],
        }
        runs: dict[str, list[dict[str, Any]]] = {label: [] for label in paths}
        for repeat in range(args.repeats):
            for label, settings in paths.items():
                runs[label].append(run(label, settings, args.steps, Path(tmp), repeat))
    data = {"steps": args.steps, "repeats": args.repeats, "rounds": args.rounds,
            "serving": serve, "runs": runs}  # fmt: skip
    publish(Record.measured("model-rewards", "Rewards from models", render, data), args.write)


if __name__ == "__main__":
    main()
