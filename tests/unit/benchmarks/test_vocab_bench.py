"""make bench-vocab's pieces: one setting measured in-process, and the section rendered from
its record."""

from dataclasses import replace

import pytest

from benchmarks.records import Record
from benchmarks.vocab import measure_one, render
from sluice.config.tree import PolicyConfig
from sluice.policy.starting import build_model, build_tokenizer, save_policy


@pytest.mark.parametrize("variant", ["whole", "chunked"])
def test_a_setting_reports_its_peak_above_the_warm_up_and_its_step_time(tmp_path, variant):
    tok = build_tokenizer()
    cfg = PolicyConfig(layers=1, hidden=32, heads=1, intermediate=64, max_positions=1024)
    save_policy(build_model(cfg, len(tok), seed=0), tok, tmp_path)
    result = measure_one(tmp_path, 1024, variant, steps=2)
    assert result["peak_bytes"] >= 0
    assert len(result["step_s"]) == 2 and min(result["step_s"]) > 0


def _record(settings: list[dict]) -> Record:
    command = ".venv/bin/python -m benchmarks.vocab --write"
    data = {"steps": 2, "settings": settings}
    title = "Logits memory at real vocabularies"
    record = Record.measured("vocab-memory", title, render, data, ["torch"], command)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_section_sets_chunked_beside_whole_and_says_out_of_memory():
    gib = 1 << 30
    smol, qwen = "SmolLM2-135M", "Qwen2.5 vocabulary, 2 layers"
    settings = [
        {"model": smol, "tokens": 1024, "variant": "whole",
         "result": {"peak_bytes": 2 * gib, "step_s": [9.0, 11.0]}},
        {"model": smol, "tokens": 1024, "variant": "chunked",
         "result": {"peak_bytes": gib, "step_s": [8.0, 10.0]}},
        {"model": qwen, "tokens": 8192, "variant": "whole", "result": None},
        {"model": qwen, "tokens": 8192, "variant": "chunked",
         "result": {"peak_bytes": gib, "step_s": [30.0, 30.0]}},
    ]  # fmt: skip
    record = _record(settings)
    text = record.text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert "`.venv/bin/python -m benchmarks.vocab --write`" in first
    assert record.machine["cpu"] in first and "2 timed steps per setting" in first
    # medians 10.0 and 9.0 s: chunked / whole 0.90
    assert "| SmolLM2-135M | 1,024 | 0.19 | 2.00 | 1.00 | 10.0 | 9.0 | 0.90 |" in text
    assert f"| {qwen} | 8,192 | 4.64 | out of memory | 1.00 | - | 30.0 | - |" in text
