"""Experiment tracking: parameters and per-step metrics to MLflow (sqlite in the run folder).

Metrics are buffered and written with ``log_batch``: one call per flush instead of one per
metric (50 single calls cost seconds against a server).
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient


class MetricLogger(Protocol):
    run_id: str

    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...


def tracking_uri(configured: str | None, default: str) -> str:
    """The config's URI, else ``MLFLOW_TRACKING_URI``, else ``default`` (sqlite in the run)."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or default


def _run_exists(client: MlflowClient, run_id: str) -> bool:
    try:
        client.get_run(run_id)
    except MlflowException:
        return False
    return True


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class MlflowLogger:
    """A :class:`MetricLogger` writing one MLflow run; flushes every ``flush_every`` steps."""

    def __init__(
        self,
        tracking_uri: str,
        artifact_root: str,
        experiment: str,
        run_name: str,
        flush_every: int = 10,
        continue_run: str | None = None,
    ) -> None:
        """A new run, or with ``continue_run`` that run again (a resumed job), if it exists."""
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found
            else self.client.create_experiment(experiment, artifact_location=artifact_root)
        )
        if continue_run and _run_exists(self.client, continue_run):
            self.run_id = continue_run
            self.client.update_run(continue_run, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.tracking_uri = tracking_uri
        self._pending: list[Metric] = []
        self._flush_every = flush_every
        self._steps = 0

    def log_params(self, params: dict[str, Any]) -> None:
        """Log the flattened tree. MLflow refuses to change a logged value: on a continued
        run (a resume with --set), a changed value is kept as the tag ``resumed.<key>``."""
        logged = self.client.get_run(self.run_id).data.params
        flat = {k: str(v) for k, v in flatten(params).items()}
        changed = {k: v for k, v in flat.items() if k in logged and logged[k] != v}
        for key, value in changed.items():
            self.client.set_tag(self.run_id, f"resumed.{key}", value)
        items = [Param(k, v) for k, v in flat.items() if k not in logged]
        for start in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self._pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self._steps += 1
        if self._steps % self._flush_every == 0:
            self.flush()

    def flush(self) -> None:
        while self._pending:
            chunk, self._pending = self._pending[:1000], self._pending[1000:]
            self.client.log_batch(self.run_id, metrics=chunk)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_artifact(self, path: str, folder: str | None = None) -> None:
        self.client.log_artifact(self.run_id, path, folder)

    def log_artifacts(self, path: str, folder: str) -> None:
        self.client.log_artifacts(self.run_id, path, folder)

    def close(self, status: str = "FINISHED") -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=status)
