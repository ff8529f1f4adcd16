"""Each algorithm of docs/algorithms.md learns the default task through the harness of the
default run's learning test (``test_learning.py``): seed 0's 100 steps of
`configs/default.yaml` with the algorithm's settings (``benchmarks/learning.py``'s
variants) must gain the held-out accuracy that test asks of the default, without a
collapse. ``make test-learning-algorithms`` (marker ``slow``; ~2 minutes an algorithm);
their three-seed table is in docs/algorithms.md (``make bench-learning-algorithms``)."""

from __future__ import annotations

import json

import pytest

from benchmarks.learning import VARIANTS
from tests.integration.test_learning import MIN_GAIN, STEPS
from tests.support.cli import sluice

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# The variants after the default (GRPO, which test_learning.py runs in the default suite).
ALGORITHMS = list(VARIANTS)[list(VARIANTS).index("Dr. GRPO") :]


@pytest.mark.parametrize("label", ALGORITHMS)
def test_the_algorithm_learns_the_default_task(tmp_path, shared_cache, label):
    root = tmp_path / "runs"
    args = ["run", "configs/default.yaml"]
    for setting in (*VARIANTS[label], f"root={root}", f"cache={shared_cache}",
                    f"train.steps={STEPS}"):  # fmt: skip
        args += ["--set", setting]
    result = sluice(*args, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((root / "default" / "summary.json").read_text())
    gain = summary["end_accuracy"] - summary["start_accuracy"]
    assert gain >= MIN_GAIN, (
        f"{label} gained {100 * gain:+.1f} points of held-out accuracy in {STEPS} steps; "
        f"the default run's test asks for {100 * MIN_GAIN:+.1f}"
    )
    assert summary["collapse"] == []
