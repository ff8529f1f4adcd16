"""The eval flow: held-out accuracy of one policy, a folder or a registered model version.

Starts Ray and one rollout worker (vLLM) on the policy, decodes the held-out set greedily
(``driver/held_out.py: evaluate``), and logs the accuracy to MLflow (and, for a registered
version, as a tag on it). Driven by ``sluice eval`` and the ``eval`` deployment.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import ray
from prefect import flow

from sluice.config.tree import build_config
from sluice.driver.tracking import MlflowLogger, tracking_uri
from sluice.engines.cluster import ray_cluster
from sluice.engines.train.lora import is_adapter, read_adapter
from sluice.storage.layout import RunLayout
from sluice.tasks import registry
from sluice.tasks.evaluation import evaluate_policy

log = logging.getLogger("sluice")


def parse_model(spec: str) -> tuple[str, str, bool]:
    """``NAME@ALIAS`` or ``NAME/VERSION`` -> (name, alias or version, is_alias)."""
    if "@" in spec:
        name, alias = spec.split("@", 1)
        if name and alias:
            return name, alias, True
    elif "/" in spec:
        name, version = spec.split("/", 1)
        if name and version.isdigit():
            return name, version, False
    raise ValueError(f"model {spec!r} is not NAME@ALIAS or NAME/VERSION")


def resolve_policy(client: Any, spec: str, into: Path) -> tuple[Path, str, str]:
    """Download a registered policy; returns (folder, name, version)."""
    name, ref, is_alias = parse_model(spec)
    version = registry.alias_version(client, name, ref) if is_alias else ref
    if version is None:
        raise ValueError(f"registered model {name!r} has no alias {ref!r}")
    return registry.download_policy(client, name, version, into), name, version


@flow(name="sluice-eval", log_prints=False)
def eval_flow(
    config: dict[str, Any], model: str | None = None, policy: str | None = None
) -> dict[str, Any]:
    """Evaluate ``policy`` (a folder) or ``model`` (NAME@ALIAS, NAME/VERSION) on held-out."""
    cfg = build_config(config)
    if (model is None) == (policy is None):
        raise ValueError("give exactly one of model (NAME@ALIAS) and policy (a folder)")
    layout = RunLayout(cfg.run_dir, cfg.cache_dir).create()
    tracker = MlflowLogger(
        tracking_uri(cfg.tracking.mlflow_uri, layout.mlflow_uri),
        layout.mlflow_artifacts.as_uri(),
        cfg.tracking.experiment,
        f"eval-{cfg.name}",
    )
    name = version = None
    if model is not None:
        scratch = Path(tempfile.mkdtemp(prefix="sluice-eval-", dir=layout.run_dir))
        folder, name, version = resolve_policy(tracker.client, model, scratch)
        policy = str(folder)
    assert policy is not None
    if is_adapter(Path(policy)):
        read_adapter(Path(policy))  # its base must be here
    elif not (Path(policy) / "config.json").is_file():
        raise ValueError(
            f"{policy} is not a policy folder (no config.json, nor a LoRA adapter_config.json)"
        )
    ray_cluster.start(cfg.rollout.cpus_per_worker, cfg.rollout.resources, layout.ray_temp)
    status = "FAILED"
    try:
        held_out = evaluate_policy(cfg, policy)
        accuracy = held_out["eval/accuracy"]
        tracker.log_params({"eval_policy": model or policy, "eval_prompts": cfg.eval.prompts})
        tracker.log_metrics(0, held_out)
        if name and version:
            tracker.client.set_model_version_tag(name, version, "eval_accuracy", f"{accuracy:.6f}")
        status = "FINISHED"
        log.info("held-out accuracy %.1f%% (%s)", 100 * accuracy, model or policy)
        return {
            "accuracy": accuracy,
            "metrics": held_out,
            "prompts": cfg.eval.prompts,
            "policy": model or policy,
        }
    finally:
        tracker.close(status)
        ray.shutdown()
