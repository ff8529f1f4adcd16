from pathlib import Path

from sluice.storage.layout import MAX_RAY_TEMP_CHARS, RunLayout


def test_everything_lives_under_the_run_its_root_or_the_cache(tmp_path):
    layout = RunLayout(tmp_path / "runs" / "x", tmp_path / "cache").create()
    for path in (layout.prefect_home, layout.final_policy, layout.summary):
        assert layout.run_dir in path.parents
    # one MLflow database per root: the model registry spans the runs under it
    for path in (layout.mlflow_db, layout.mlflow_artifacts):
        assert path.parent == tmp_path / "runs"
    for path in (layout.vllm_cache, layout.inductor_cache):
        assert layout.cache_dir in path.parents
    assert layout.mlflow_uri == f"sqlite:///{layout.mlflow_db}"
    assert layout.prefect_home.is_dir()


def test_ray_temp_moves_to_a_short_path_when_the_run_folder_is_deep():
    short = RunLayout(Path("/r/x"), Path("/c"))
    assert short.ray_temp == Path("/r/x/ray")
    deep = RunLayout(Path("/" + "d" * MAX_RAY_TEMP_CHARS) / "x", Path("/c"))
    assert len(str(deep.ray_temp)) <= MAX_RAY_TEMP_CHARS
    assert deep.ray_temp != RunLayout(Path("/" + "e" * MAX_RAY_TEMP_CHARS), Path("/c")).ray_temp
