"""A retrain starts from the champion; a LoRA champion is an adapter, so it starts from
the champion's merged export, and without one it stops before any work with the fix."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from sluice.config.tree import ConfigError, build_config
from sluice.flows.retrain import retrain_config

NOW = datetime(2026, 11, 26, tzinfo=UTC)


def test_a_lora_champion_starts_the_retrain_from_its_merged_export(tmp_path):
    champion = tmp_path / "champion"
    (champion / "merged").mkdir(parents=True)
    (champion / "adapter_config.json").write_text("{}")
    cfg = build_config({"name": "job", "root": str(tmp_path), "train": {"lora": {}}})
    with pytest.raises(ConfigError, match=r"without a merged export.*merged_export: true"):
        retrain_config(cfg, str(champion), NOW)
    (champion / "merged" / "config.json").write_text("{}")
    assert retrain_config(cfg, str(champion), NOW).policy.path == str(champion / "merged")


def test_a_full_champion_is_the_start_as_it_is(tmp_path):
    cfg = build_config({"name": "job", "root": str(tmp_path)})
    assert retrain_config(cfg, str(tmp_path), NOW).policy.path == str(tmp_path)
