"""make bench-vocab's pieces: one setting measured in-process, and the table."""

import pytest

from benchmarks.vocab import measure_one, table
from sluice.config.tree import PolicyConfig
from sluice.policy.starting import build_model, build_tokenizer, save_policy


@pytest.mark.parametrize("variant", ["whole", "chunked"])
def test_a_setting_reports_its_peak_above_the_warm_up_and_its_step_time(tmp_path, variant):
    tok = build_tokenizer()
    cfg = PolicyConfig(layers=1, hidden=32, heads=1, intermediate=64, max_positions=1024)
    save_policy(build_model(cfg, len(tok), seed=0), tok, tmp_path)
    result = measure_one(tmp_path, 1024, variant, steps=1)
    assert result["peak_bytes"] >= 0 and result["step_s"] > 0


def test_the_table_sets_chunked_beside_whole_and_says_out_of_memory():
    gib = 1 << 30
    results = {
        ("SmolLM2-135M", 1024, "whole"): {"peak_bytes": 2 * gib, "step_s": 10.0},
        ("SmolLM2-135M", 1024, "chunked"): {"peak_bytes": gib, "step_s": 9.0},
        ("Qwen2.5 vocabulary, 2 layers", 8192, "whole"): None,
        ("Qwen2.5 vocabulary, 2 layers", 8192, "chunked"): {"peak_bytes": gib, "step_s": 30.0},
    }
    smol, qwen = table(results)
    assert smol == ["SmolLM2-135M", "1,024", "0.19", "2.00", "1.00", "10.0", "9.0", "0.90"]
    assert qwen[3] == "out of memory" and qwen[2] == "4.64" and qwen[-1] == "-"
