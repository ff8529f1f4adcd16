"""What a pool asks Ray for and runs in, per platform: GPUs, dtype, vLLM's engine arguments."""

from __future__ import annotations

import pytest

from sluice.config.tree import ConfigError, load_config
from sluice.engines.cluster.ray_cluster import gpus_each, pool_dtype, thread_env
from sluice.engines.rollout.vllm_engine import GIB, engine_args


def test_cpu_defaults_keep_what_runs_here():
    assert engine_args(on_gpu=False) == {
        "dtype": "float32",
        "enforce_eager": True,
        "enable_chunked_prefill": False,  # seeded CPU sampling cannot rewind (vllm_rollout)
        "kv_cache_memory_bytes": GIB // 2,  # vLLM's own probe refuses small CPU machines
    }


def test_gpu_defaults_let_vllm_size_its_cache_and_use_cuda_graphs():
    assert engine_args(on_gpu=True, gpu_memory_utilization=0.8) == {
        "dtype": "bfloat16",
        "enforce_eager": False,
        "gpu_memory_utilization": 0.8,
    }


def test_explicit_choices_win_on_either_platform():
    args = engine_args(True, dtype="float32", kv_cache_gib=2.0, enforce_eager=True)
    assert args["dtype"] == "float32" and args["enforce_eager"] is True
    assert args["kv_cache_memory_bytes"] == 2 * GIB
    assert engine_args(False, dtype="bfloat16")["dtype"] == "bfloat16"


def test_auto_dtype_follows_the_gpus_a_pool_holds():
    assert pool_dtype("auto", 1.0) == "bfloat16"
    assert pool_dtype("auto", 0.0) == "float32"
    assert pool_dtype("float32", 1.0) == "float32"


def test_an_actor_without_a_gpu_sees_none():
    """Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone for num_gpus=0: it would see all GPUs."""
    assert thread_env(2, {}, gpus=0)["env_vars"]["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in thread_env(2, {}, gpus=1)["env_vars"]


def test_an_asked_gpu_count_is_used_as_given():
    assert gpus_each(0.5) == 0.5 and gpus_each(0) == 0


def test_the_config_takes_devices_and_refuses_gpu_in_custom_resources():
    cfg = load_config(
        None,
        [
            "rollout.gpus_per_worker=1",
            "train.gpus_per_rank=1",
            "rollout.dtype=bfloat16",
            "train.dtype=bfloat16",
            "rollout.gpu_memory_utilization=0.85",
        ],
    )
    assert (cfg.rollout.gpus_per_worker, cfg.train.gpus_per_rank) == (1, 1)
    assert cfg.rollout.kv_cache_gib is None and cfg.rollout.enforce_eager is None
    with pytest.raises(ConfigError, match=r"rollout\.dtype"):
        load_config(None, ["rollout.dtype=float8"])
    with pytest.raises(ConfigError, match="gpus_per_worker"):
        load_config(None, ["rollout.resources.GPU=1"])


def test_a_tensor_parallel_worker_asks_for_a_gpu_per_rank(monkeypatch):
    import sluice.engines.cluster.ray_cluster as cluster

    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 4.0, "GPU": 4.0})
    assert gpus_each(None, ranks=2) == 2.0 and gpus_each(None) == 1.0
    monkeypatch.setattr(cluster.ray, "cluster_resources", lambda: {"CPU": 4.0})
    assert gpus_each(None, ranks=2) == 0.0  # a CPU cluster: the ranks run on CPU cores


def test_the_config_refuses_a_gpu_count_other_than_the_tensor_parallel_ranks():
    cfg = load_config(None, ["rollout.tensor_parallel_size=2"])
    assert cfg.rollout.tensor_parallel_size == 2 and cfg.rollout.gpus_per_worker is None
    for fine in ("2", "0"):  # one GPU a rank, or the ranks on CPUs
        load_config(None, ["rollout.tensor_parallel_size=2", f"rollout.gpus_per_worker={fine}"])
    with pytest.raises(ConfigError, match=r"it asks for 2 \(leave gpus_per_worker unset"):
        load_config(None, ["rollout.tensor_parallel_size=2", "rollout.gpus_per_worker=1"])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        load_config(None, ["rollout.tensor_parallel_size=0"])
