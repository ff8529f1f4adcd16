"""Process settings a run needs before Prefect, MLflow, Ray or vLLM are imported.

Each library reads its home and cache folders from the environment at import time, so the
CLI calls :func:`configure_process` first: then nothing a run writes lands in the home
directory, and nothing reaches for the network.
"""

from __future__ import annotations

import json
import os

from sluice.storage.layout import RunLayout
from sluice.storage.urls import CREDENTIAL_VARS

# Prefect's temporary API server needs ~11 s to start on 2 cores; its default limit is 20 s.
PREFECT_STARTUP_TIMEOUT_S = "120"


def configure_process(layout: RunLayout, prefect: bool = True) -> None:
    """Point every library's home and caches at the run's folders; ``prefect=False`` in a
    flow run that a Prefect worker started (Prefect is configured and connected already)."""
    layout.create()
    settings = {
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
    if prefect:
        settings |= {
            "PREFECT_HOME": str(layout.prefect_home),
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": PREFECT_STARTUP_TIMEOUT_S,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
        }
    os.environ.update(settings)


def use_credentials_block(name: str) -> None:
    """Put the storage credentials held by the Prefect secret block ``name`` into this
    process's environment (where ``storage.urls`` and the actors' environment read them).

    The block's value is a JSON object with some of ``storage.urls.CREDENTIAL_VARS`` as keys,
    e.g. ``{"AWS_ACCESS_KEY_ID": "...", "AWS_SECRET_ACCESS_KEY": "..."}``. Values are never
    logged; a bad block is named in the error, its contents are not.
    """
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except ValueError as error:
        raise ValueError(f"storage.credentials_block: no Prefect secret block {name!r}") from error
    data = json.loads(value) if isinstance(value, str) else value
    if not isinstance(data, dict) or not data:
        raise ValueError(f"secret block {name!r} must hold a JSON object of variables")
    unknown = sorted(set(data) - set(CREDENTIAL_VARS))
    if unknown:
        raise ValueError(
            f"secret block {name!r} has keys {unknown}; allowed: {', '.join(CREDENTIAL_VARS)}"
        )
    os.environ.update({k: str(v) for k, v in data.items()})
