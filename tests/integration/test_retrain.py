"""Retraining end to end: `sluice retrain` twice and `sluice eval` on the real components.

The first retrain has no champion, so its policy becomes one; `sluice eval` scores the
champion; the second retrain starts from that champion and, asked for an impossible gain,
keeps it and says why.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from sluice.tasks import registry
from tests.support.cli import sluice

# Three real jobs in a row (about 5 minutes): `make test-slow`. The promote/keep step itself
# runs in the default suite on a real registry (tests/integration/test_registry.py).
pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_retrain_promotes_then_keeps_the_champion(tmp_path, shared_cache):
    root = tmp_path / "runs"
    common = [
        "configs/smoke.yaml",
        "--set",
        f"root={root}",
        "--set",
        f"cache={shared_cache}",
        "--set",
        "train.steps=2",
        "--set",
        "mode=sync",
    ]
    first = sluice("retrain", *common)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "sluice-policy version 1 promoted to champion: there is no champion yet" in first.stdout

    scored = sluice("eval", *common[:1], "--model", "sluice-policy@champion", *common[1:])
    assert scored.returncode == 0, scored.stdout[-3000:] + scored.stderr[-3000:]
    assert "held-out accuracy" in scored.stdout and "sluice-policy@champion" in scored.stdout

    second = sluice("retrain", *common, "--min-gain", "1.0")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "retraining from sluice-policy version 1 (champion)" in second.stdout
    assert "sluice-policy version 2 not promoted" in second.stdout
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    assert registry.alias_version(client, "sluice-policy", registry.CHAMPION) == "1"
    assert registry.alias_version(client, "sluice-policy", registry.CHALLENGER) == "2"
    runs = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("smoke-"))
    assert len(runs) == 2  # each retrain is its own dated run
