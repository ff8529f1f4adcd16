"""benchmarks/trl_generations.py: a failed way's error and TRL frame, and the table of the
ways that ran, paired with padded generate within a round."""

from benchmarks.trl_generations import failure, table

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


def test_the_table_pairs_each_way_with_generate_and_names_what_failed():
    results = {
        "generate": [{"generate_s": 1.0, "samples_per_s": 100.0}] * 2,
        "continuous": [
            {"generate_s": 5.0, "samples_per_s": 20.0},
            {"generate_s": 6.0, "samples_per_s": 25.0},
        ],
        "vllm-colocate": ["AttributeError: no weight_loader (from sync_weights, trl/x.py:1)"],
    }
    text = table(results, steps=6, rounds=2)
    assert "| generate | ran 2 of 2 | 1.00 s (1.00-1.00) | 1.00x (1.00-1.00) |" in text
    assert (
        "| continuous | ran 2 of 2 | 5.50 s (5.00-6.00) | 5.50x (5.00-6.00) | 22.5 (20.0-25.0)"
        in text
    )
    assert "| vllm-colocate | fails: AttributeError: no weight_loader (from sync_weights" in text
