"""Which weights sampled a token, when vLLM keeps a batch in flight.

On CUDA vLLM 0.32 runs async scheduling: ``step`` returns the tokens of the batch
scheduled the step before and has already scheduled the next, whose tokens the engine core
counts as ``num_output_placeholders`` until they come back. A weight load between two steps
runs after that batch on the device, so its tokens were sampled by the old weights. The CPU
platform turns async scheduling off (tests/integration/test_vllm_engine.py holds the real
engine's count to 0 in flight); here a scripted in-process vLLM keeps a batch in flight and
records which version sampled each token.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sluice.engines.rollout.vllm_engine import VLLMRolloutEngine


class _AsyncCore:
    """vLLM's LLMEngine as the rollout engine reads it, over a scripted engine core whose
    scheduler keeps one decode step in flight (AsyncScheduler), one request at a time."""

    def __init__(self, in_flight: bool) -> None:
        self.in_flight, self.version = in_flight, 0
        self.request = SimpleNamespace(num_output_placeholders=0)
        self.sampled_by: list[int] = []  # the weights' version of each token sampled
        self.returned = 0  # tokens handed back through the output processor
        detokenizer = SimpleNamespace(num_output_tokens=lambda: self.returned)
        self.output_processor = SimpleNamespace(
            external_req_ids={"r": ["r-internal"]},
            request_states={"r-internal": SimpleNamespace(detokenizer=detokenizer)},
        )
        scheduler = SimpleNamespace(requests={"r-internal": self.request})
        self.engine_core = SimpleNamespace(engine_core=SimpleNamespace(scheduler=scheduler))

    def _schedule(self) -> None:
        self.sampled_by.append(self.version)  # sampled by the weights there at launch
        self.request.num_output_placeholders += 1

    def step(self) -> list[object]:
        """Return what was in flight and launch the next token; without async scheduling
        launch and return in one step."""
        if not self.in_flight:
            self._schedule()
        done = self.request.num_output_placeholders
        self.request.num_output_placeholders = 0
        self.returned += done
        if self.in_flight:
            self._schedule()
        return []

    def get_num_unfinished_requests(self) -> int:
        return 1


def _engine(core: _AsyncCore) -> VLLMRolloutEngine:
    engine = VLLMRolloutEngine.__new__(VLLMRolloutEngine)  # no vLLM: the scripted one

    def load(_name: str, args: tuple[object, ...]) -> None:
        core.version += 1

    engine._llm = SimpleNamespace(llm_engine=core, collective_rpc=load)
    engine._lora, engine._version, engine._tensor_parallel = None, 0, False
    return engine


@pytest.mark.parametrize("in_flight", [True, False], ids=["async-scheduling", "cpu"])
def test_a_weight_loads_mark_falls_where_the_new_weights_sampled_first(in_flight):
    core = _AsyncCore(in_flight)
    engine = _engine(core)
    for _ in range(5):
        engine.step()
    mark = engine.generated("r")  # the worker marks the version it loads from here
    returned = core.returned  # what step has handed back so far
    engine.load_weights([], version=1)
    for _ in range(3):
        engine.step()
    assert core.sampled_by[:mark] == [0] * mark
    assert core.sampled_by[mark:] == [1] * (len(core.sampled_by) - mark)
    assert mark == returned + in_flight  # the token in flight counts under the old version
