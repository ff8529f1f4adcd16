"""benchmarks/sim_profile.py: Sluice's benchmark variants as simulator policies."""

from __future__ import annotations

from pathlib import Path

from sluice.benchmarks.modes import VARIANTS
from sluice.benchmarks.sim_profile import modes_table, variants

ROOT = Path(__file__).parents[3]


def test_every_one_worker_benchmark_variant_becomes_a_policy_with_sluices_defaults():
    policies = variants()
    one_worker = [label for label, o in VARIANTS if not any("rollout.workers" in a for a in o)]
    assert list(policies) == one_worker and "async k=2, 2 workers" not in policies
    assert policies["sync"]["mode"] == "sync"
    assert policies["async k=4"] == {
        "mode": "async",
        "max_staleness": 4,
        "long_first": True,
        "balance": True,
        "partial_rollout": True,
    }
    off = policies["async k=2, dispatch off"]
    assert (off["long_first"], off["balance"]) == (False, False)
    assert policies["async k=2, no partial rollout"]["partial_rollout"] is False


def test_modes_table_reads_the_measured_rows(tmp_path):
    table = (
        "<!-- modes:begin -->\n| variant | samples/s | tokens/s | x sync | step s | trainer "
        "idle | rollout idle | mean staleness | held-out |\n|---|\n"
        "| sync | 1,102.2 | 2492 | 1.00 | 1.220 | 0.48 | - | 0.00 | x |\n"
        "| async k=2 | 130.2 | 3225 | 1.27 | 0.945 | 0.23 | 0.08 | 1.10 | x |\n"
        "<!-- modes:end -->\n"
    )
    (tmp_path / "B.md").write_text(table)
    rows = modes_table(tmp_path / "B.md")
    assert rows["sync"] == {
        "samples_per_s": 1102.2,
        "step_s": 1.22,
        "trainer_idle": 0.48,
        "mean_staleness": 0.0,
    }
    assert rows["async k=2"]["mean_staleness"] == 1.10
    assert set(modes_table(ROOT / "BENCHMARKS.md")) == {label for label, _ in VARIANTS}
