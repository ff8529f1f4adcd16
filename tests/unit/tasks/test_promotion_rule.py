"""The champion/challenger rule of the retrain flow."""

import pytest

from sluice.tasks import registry


@pytest.mark.parametrize(
    ("champion", "challenger", "min_gain", "promote"),
    [
        (None, 0.1, 0.0, True),
        (0.5, 0.5, 0.0, False),
        (0.5, 0.52, 0.05, False),
        (0.5, 0.56, 0.05, True),
        (0.5, 0.6, -1.0, True),
        (0.5, 0.4, -1.0, False),
    ],
    ids=["no-champion", "equal", "below-min-gain", "above-min-gain", "negative-min-gain", "worse"],
)
def test_decide(champion, challenger, min_gain, promote):
    assert registry.decide(champion, challenger, min_gain).promote is promote
