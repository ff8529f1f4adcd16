"""Whether a run's pools fit the embedded cluster's machine (``engines/cluster/fit.py``)."""

from __future__ import annotations

from sluice.engines.cluster.fit import GIB, Ask, misfit


def test_the_estimate_adds_each_actor_and_the_fixed_part():
    ask = Ask(rollout_workers=2, kv_cache_gib=0.5, train_ranks=1, weights_bytes=GIB // 2)
    # 2 x (0.64 + 0.5 + 0.5) + (0.40 + 4 x 0.5) + 2.0
    assert round(ask.total_gib(), 2) == round(2 * 1.64 + 2.40 + 2.0, 2)
    assert misfit(ask, 24 * GIB) is None


def test_too_many_rollout_workers_are_refused_with_how_many_fit():
    ask = Ask(rollout_workers=64, kv_cache_gib=0.5, train_ranks=1, weights_bytes=0)
    why = misfit(ask, 24 * GIB)
    assert why is not None
    # (24 - 2.0 - 0.40) // 1.14 = 18 workers fit
    assert "rollout.workers=64 x ~1.1 GiB" in why and "at most 18 fit here" in why
    assert misfit(Ask(18, 0.5, 1, 0), 24 * GIB) is None
    assert misfit(Ask(19, 0.5, 1, 0), 24 * GIB) is not None
