"""What an engine sampled, recorded for tests that check a trajectory token for token."""

from __future__ import annotations

from typing import Any


def record_sampled(engine: Any) -> dict[str, list[int]]:
    """Wrap ``engine.step`` so that every token it samples from now on is kept, by request
    id; the returned dict fills as the engine steps."""
    sampled: dict[str, list[int]] = {}
    step = engine.step

    def recording_step() -> Any:
        deltas = step()
        for delta in deltas:
            sampled.setdefault(delta.request_id, []).extend(delta.token_ids)
        return deltas

    engine.step = recording_step
    return sampled
