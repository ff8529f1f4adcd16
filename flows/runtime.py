"""Process settings a run needs before Prefect, MLflow, Ray or vLLM are imported.

Each library reads its home and cache folders from the environment at import time, so the
CLI calls :func:`configure_process` first: then nothing a run writes lands in the home
directory, and nothing reaches for the network.
"""

from __future__ import annotations

import os

from storage.layout import RunLayout
from storage.urls import credential_env

# Prefect's temporary API server needs ~11 s to start on 2 cores; its default limit is 20 s.
PREFECT_STARTUP_TIMEOUT_S = "120"


def configure_process(layout: RunLayout) -> None:
    layout.create()
    settings = {
        "PREFECT_HOME": str(layout.prefect_home),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": PREFECT_STARTUP_TIMEOUT_S,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "VLLM_CACHE_ROOT": str(layout.vllm_cache),
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(layout.inductor_cache),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(layout.cache_dir / "huggingface"),
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
        "DO_NOT_TRACK": "1",
    }
    os.environ.update(settings)


def child_env() -> dict[str, str]:
    """Variables Ray actors need (they do not inherit this process's later changes)."""
    keys = (
        "VLLM_CACHE_ROOT",
        "VLLM_NO_USAGE_STATS",
        "VLLM_DO_NOT_TRACK",
        "TORCHINDUCTOR_CACHE_DIR",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HOME",
        "TOKENIZERS_PARALLELISM",
        "PYTHONPATH",
    )
    return {**{k: os.environ[k] for k in keys if k in os.environ}, **credential_env()}
