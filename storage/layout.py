"""Where a run's files live: under ``<root>/<name>/``, except the MLflow database and
artifacts, which every run under ``<root>`` shares; shared caches under ``<cache>``."""

from __future__ import annotations

import hashlib
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sluice.storage import fsio
from sluice.storage.urls import open_url

# What a run keeps under its storage URL (``storage/ledger.py``, ``trajectory_store.py``,
# ``checkpoints.py``). A fresh run refuses a URL that holds any of them: it would append to
# another run's ledger and prune its checkpoints.
DURABLE_FOLDERS = ("ledger", "trajectories", "checkpoints")

# Unix socket paths are limited to 107 bytes and Ray puts its sockets about 60 characters
# deep under its temp dir, so a longer temp dir is moved to a short private path in /tmp.
MAX_RAY_TEMP_CHARS = 45
_PLAIN_PATH = re.compile(r"^[A-Za-z0-9_./-]+$")


@dataclass(frozen=True)
class RunLayout:
    """Paths of one run. ``create()`` makes the folders."""

    run_dir: Path
    cache_dir: Path

    @property
    def mlflow_db(self) -> Path:
        """One MLflow database for every run under the same root: the model registry spans
        runs (retraining continues from another run's registered policy)."""
        return self.run_dir.parent / "mlflow.db"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.mlflow_db}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.run_dir.parent / "mlartifacts"

    @property
    def prefect_home(self) -> Path:
        return self.run_dir / "prefect"

    @property
    def final_policy(self) -> Path:
        return self.run_dir / "policy"

    @property
    def best_policy(self) -> Path:
        return self.run_dir / "best_policy"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def ray_temp(self) -> Path:
        preferred = self.run_dir / "ray"
        # Ray encodes its socket paths as ASCII and passes them on command lines: a run
        # folder with any other character gets the short private path too.
        if _PLAIN_PATH.match(str(preferred)) and len(str(preferred)) <= MAX_RAY_TEMP_CHARS:
            return preferred
        digest = hashlib.sha256(str(self.run_dir).encode()).hexdigest()[:10]
        return Path(tempfile.gettempdir()) / f"sluice-ray-{digest}"

    @property
    def vllm_cache(self) -> Path:
        return self.cache_dir / "vllm"

    @property
    def inductor_cache(self) -> Path:
        return self.cache_dir / "inductor"

    def create(self) -> RunLayout:
        for folder in (self.run_dir, self.cache_dir, self.prefect_home, self.mlflow_artifacts):
            folder.mkdir(parents=True, exist_ok=True)
        return self


def durable_state(url: str) -> list[str]:
    """The durable folders under a run's storage ``url`` that hold anything."""
    fs, root = open_url(url)
    return [name for name in DURABLE_FOLDERS if fsio.list_names(fs, fsio.join(root, name))]
