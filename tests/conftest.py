"""Shared fixtures. Process settings go in before any test module imports Prefect or vLLM."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="sluice-tests-"))
os.environ.update(
    {
        "PREFECT_HOME": str(_SESSION_DIR / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
)


@pytest.fixture(scope="session")
def session_dir() -> Path:
    return _SESSION_DIR


@pytest.fixture(scope="session")
def shared_cache(session_dir: Path) -> Path:
    """One cache folder for the end-to-end runs: the smoke policy is warm-started once."""
    return session_dir / "run-cache"


@pytest.fixture(scope="session")
def tiny_policy(session_dir: Path) -> Path:
    """A small untrained-but-saved policy folder (no warm start), built once per session."""
    from sluice.config.tree import EnvConfig, PolicyConfig
    from sluice.driver.environment import make_environment
    from sluice.policy.starting import prepare_policy

    env, signature = make_environment(EnvConfig())
    cfg = PolicyConfig(layers=2, hidden=64, heads=2, intermediate=128, warmstart_max_steps=0)
    return prepare_policy(cfg, env, signature, seed=0, cache_dir=session_dir / "cache")


@pytest.fixture(scope="session")
def ray_local(session_dir: Path):
    """A local Ray instance with two CPU slots, shut down at the end of the session."""
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))),
        log_to_driver=False,
        configure_logging=False,
    )
    yield ray
    ray.shutdown()


# The edit loop's tier (``make test-fast``): no Ray, no vLLM. A test that starts either
# through the fixtures below, or is marked ``integration``, is left out of it.
FAST = os.environ.get("SLUICE_TEST_FAST") == "1"
NOT_FAST_FIXTURES = {"ray_local", "in_process_vllm"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``make test-fast`` leaves out what starts Ray or vLLM; tests marked ``gpu`` skip on a
    machine without a CUDA device (``make test-gpu``)."""
    if FAST:
        slow = [
            item
            for item in items
            if NOT_FAST_FIXTURES & set(getattr(item, "fixturenames", ()))
            or item.get_closest_marker("integration")
        ]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item not in set(slow)]
    gpu_tests = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_tests:
        return  # torch is not imported for a run without them
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_tests:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def bpe_policy(session_dir: Path) -> Path:
    """A model folder with a byte-level BPE tokenizer and a ChatML chat template, built once
    per session (``tests/support/bpe_policy.py``)."""
    from tests.support.bpe_policy import build_bpe_policy

    return build_bpe_policy(session_dir / "bpe-policy")


@pytest.fixture
def in_process_vllm():
    """vLLM engines made in this test run in the test's process (as in a rollout actor) and
    are gone when it ends. vLLM keeps one process-wide parallel state, which an engine tears
    down when it is collected: an engine left for the garbage collector would tear down the
    state of the next test's engine."""
    import gc

    patch = pytest.MonkeyPatch()
    patch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    gc.collect()  # engines an earlier test left behind go now, not under this test's
    yield
    patch.undo()
    gc.collect()
