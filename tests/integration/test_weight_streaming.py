"""The weight-streaming benchmark on a small llama: what a pull and a relay hold.

Runs the real entry point (``benchmarks/weights.py``) in a process of its own, since it
starts its own Ray session (Ray's object freeing set to 10 ms, so the object store shows
what the service holds rather than what Ray has yet to free). Marked ``serial``: with a
test beside it loading the cores, Ray frees late and a pull's peak showed two versions.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.serial]


def test_a_pull_adds_less_than_a_bucket_and_a_relay_holds_one_version(tmp_path):
    out = tmp_path / "weights.json"
    small = ["--layers", "2", "--hidden", "512", "--intermediate", "1408", "--vocab", "8000"]
    run = ["--bucket-mib", "4", "--repeats", "3", "--json", str(out)]
    subprocess.run(
        [sys.executable, "-m", "benchmarks.weights", *small, *run],
        check=True,
        timeout=300,
        capture_output=True,
    )
    result = json.loads(out.read_text())
    s, model, bucket = result["summary"], result["model_bytes"], result["bucket_bytes"]
    assert model > 6 * bucket  # many buckets: a joined version would show
    # The puller's private memory beyond the model's own weights: views of the object store
    # read bucket by bucket, never the version joined or copied.
    assert s["pull_private_over_model_buckets"] <= 1.25
    # The relay copies bucket by bucket into the object store; it keeps nothing private.
    assert s["relay_private_buckets"] <= 1.25
    # During the first hand-over the object store holds the relay's copy and at most the
    # publisher's two buckets in flight, never the incoming version beside the copy.
    assert s["store_first_publish_models"] <= 1 + 2 * bucket / model + 0.01
    # After a pull only the version served is left.
    assert max(run["pull.store"] for run in result["runs"]) <= 1.01 * model
