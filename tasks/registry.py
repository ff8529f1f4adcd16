"""The MLflow model registry: trained policies as registered model versions, and the
champion/challenger decision the retrain flow makes.

A finished run logs its policy folder (safetensors + tokenizer + config) as the artifact
``policy`` of its MLflow run and registers it as a new version of ``tracking.model_name``
with the alias ``challenger``. A LoRA run's policy folder is its adapter
(``adapter_config.json`` names the base model folder; ``merged/`` holds the merged model
when ``train.lora.merged_export`` asked for it); its version is tagged ``base_model``.
The retrain flow compares the challenger's held-out accuracy with the champion's,
measured on the same held-out set in the same run, and moves the ``champion`` alias only
when the challenger is better by at least ``min_gain``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from sluice.engines.train.lora import is_adapter, read_adapter

log = logging.getLogger("sluice")

CHAMPION, CHALLENGER = "champion", "challenger"
POLICY_ARTIFACT = "policy"


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str


def decide(champion: float | None, challenger: float, min_gain: float) -> Decision:
    """Promote the challenger only if its held-out accuracy beats the champion's by min_gain."""
    if champion is None:
        return Decision(True, "there is no champion yet")
    gain = challenger - champion
    verdict = (
        f"held-out accuracy {100 * challenger:.1f}% vs champion's {100 * champion:.1f}% "
        f"({100 * gain:+.1f} points; promotion needs at least {100 * min_gain:+.1f})"
    )
    return Decision(gain >= min_gain and gain > 0, verdict)


def register_policy(
    client: MlflowClient,
    model_name: str,
    run_id: str,
    folder: Path,
    accuracy: float,
    extra_tags: dict[str, str] | None = None,
) -> str:
    """Log ``folder`` as the run's policy artifact and register it; returns the version.
    ``extra_tags`` go on the version (a collapsed run's says what collapsed)."""
    client.log_artifacts(run_id, str(folder), POLICY_ARTIFACT)
    try:
        client.get_registered_model(model_name)
    except MlflowException:
        client.create_registered_model(
            model_name, description="Policies trained by Sluice (safetensors model folders)."
        )
    source = f"{client.get_run(run_id).info.artifact_uri}/{POLICY_ARTIFACT}"
    tags = {"heldout_accuracy": f"{accuracy:.6f}", **(extra_tags or {})}
    if is_adapter(folder):
        tags["base_model"] = read_adapter(folder)[0]
    version = client.create_model_version(model_name, source, run_id, tags=tags).version
    client.set_registered_model_alias(model_name, CHALLENGER, version)
    return str(version)


def alias_version(client: MlflowClient, model_name: str, alias: str) -> str | None:
    """The version an alias points at, or None if the model or alias does not exist."""
    try:
        return str(client.get_model_version_by_alias(model_name, alias).version)
    except MlflowException:
        return None


def download_policy(client: MlflowClient, model_name: str, version: str, into: Path) -> Path:
    """Fetch a registered policy folder (to start a retrain or an evaluation from it)."""
    run_id = client.get_model_version(model_name, version).run_id
    if run_id is None:
        raise ValueError(f"{model_name} version {version} was not registered from a run")
    into.mkdir(parents=True, exist_ok=True)
    return Path(client.download_artifacts(run_id, POLICY_ARTIFACT, str(into)))


def apply(client: MlflowClient, model_name: str, challenger: str, decision: Decision) -> None:
    """Move ``champion`` to the challenger when promoted; record the decision either way."""
    client.set_model_version_tag(model_name, challenger, "promotion", decision.reason)
    if decision.promote:
        client.set_registered_model_alias(model_name, CHAMPION, challenger)


@task(name="promote-or-keep", retries=2, retry_delay_seconds=[2, 10], cache_policy=NO_CACHE)
def promote_or_keep(
    client: MlflowClient,
    model_name: str,
    challenger: str,
    champion_accuracy: float | None,
    challenger_accuracy: float,
    min_gain: float,
) -> Decision:
    """Promote ``challenger`` to champion if it beats the champion by ``min_gain``."""
    decision = decide(champion_accuracy, challenger_accuracy, min_gain)
    apply(client, model_name, challenger, decision)
    if decision.promote:
        log.info("promoted %s version %s to champion: %s", model_name, challenger, decision.reason)
    else:
        kept = alias_version(client, model_name, CHAMPION)
        log.info("kept %s version %s as champion: %s", model_name, kept, decision.reason)
    return decision
