"""benchmarks/trl_generations.py: a failed way's error and TRL frame, and the section, from
its record: the ways that ran, their first steps left out, paired with padded generate within
a round."""

from dataclasses import replace

from benchmarks.records import Record
from benchmarks.trl_generations import failure, render

COMMAND = ".venv/bin/python -m benchmarks.trl_generations --steps 3 --rounds 2 --write"

LOG = """\
21:22:00 Triton is installed but 0 active driver(s) found (expected 1).
[rank0]: Traceback (most recent call last):
[rank0]:   File "/v/lib/python3.11/site-packages/trl/trainer/grpo_trainer.py", line 1771, in _gen
[rank0]:     self.vllm_generation.sync_weights()
[rank0]:   File "/v/site-packages/trl/generation/vllm_gen.py", line 511, in sync_weights
[rank0]:     self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(x)
[rank0]:   File "/v/site-packages/vllm/model_executor/layers/linear.py", line 1341, in lw
[rank0]:     param.weight_loader(param, loaded_weight, shard_id)
[rank0]: AttributeError: 'Parameter' object has no attribute 'weight_loader'
"""


def test_a_failure_is_its_exception_and_the_deepest_trl_frame():
    assert failure(LOG) == (
        "AttributeError: 'Parameter' object has no attribute 'weight_loader' "
        "(from sync_weights, trl/generation/vllm_gen.py:511)"
    )
    assert failure("killed\n") == "killed"  # no exception, no frame: the last line


def _run(generate_s: float, samples_per_s: float) -> dict[str, list[float]]:
    """Three steps: a slow first one (left out), then two of ``generate_s`` seconds
    generating, 64 samples each, at ``samples_per_s``."""
    step = 64 / samples_per_s
    return {"step_s": [99.0, step, step], "generate_s": [50.0, generate_s, generate_s],
            "samples": [1, 64, 64]}  # fmt: skip


def _record(runs: dict) -> Record:
    data = {"config": "configs/longtail.yaml", "steps": 3, "rounds": 2, "threads": 2, "runs": runs}
    title = "TRL's generation, measured"
    record = Record.measured("trl-generation", title, render, data, ["torch"], COMMAND)
    return replace(record, commit="abc1234", date="2026-11-30 17:40 UTC")


def test_the_section_pairs_each_way_with_generate_and_names_what_failed():
    runs = {
        "generate": [_run(1.0, 100.0)] * 2,
        "continuous": [_run(5.0, 20.0), _run(6.0, 25.0)],
        "vllm-colocate": ["AttributeError: no weight_loader (from sync_weights, trl/x.py:1)"],
    }
    text = _record(runs).text()
    first = text.splitlines()[0]
    assert first.startswith("Measured 2026-11-30 at commit abc1234 on ")
    assert f"`{COMMAND}`" in first and "`configs/longtail.yaml`" in first
    assert "for 3 steps of 16 prompts x 8 completions per way, 2 rounds, 2 torch threads" in first
    assert "| generate | ran 2 of 2 | 1.00 s (1.00-1.00) | 1.00x (1.00-1.00) |" in text
    assert (
        "| continuous | ran 2 of 2 | 5.50 s (5.00-6.00) | 5.50x (5.00-6.00) | 22.5 (20.0-25.0)"
        in text
    )
    assert "| vllm-colocate | fails: AttributeError: no weight_loader (from sync_weights" in text
