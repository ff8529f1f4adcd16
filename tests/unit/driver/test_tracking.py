import sqlite3

from sluice.driver.tracking import MlflowLogger, flatten


def test_flatten_nested_config():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": None}) == {
        "a.b": 1,
        "a.c.d": "x",
        "e": None,
    }


def test_mlflow_logger_writes_params_and_batched_metrics(tmp_path):
    db = tmp_path / "mlflow.db"
    logger = MlflowLogger(
        f"sqlite:///{db}", (tmp_path / "art").as_uri(), "exp", "run", flush_every=3
    )
    logger.log_params({"train": {"lr": 0.1}, "name": "run"})
    for step in range(5):
        logger.log_metrics(step, {"loss": float(step), "reward": 0.5})
    logger.close()
    with sqlite3.connect(db) as conn:
        params = dict(conn.execute("SELECT key, value FROM params").fetchall())
        losses = conn.execute(
            "SELECT step, value FROM metrics WHERE key='loss' ORDER BY step"
        ).fetchall()
        status = conn.execute("SELECT status FROM runs").fetchone()[0]
    assert params == {"train.lr": "0.1", "name": "run"}
    assert losses == [(s, float(s)) for s in range(5)]  # the unflushed tail is written at close
    assert status == "FINISHED"


def test_a_continued_run_keeps_changed_params_as_tags(tmp_path):
    uri, art = f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "art").as_uri()
    first = MlflowLogger(uri, art, "exp", "run")
    first.log_params({"train": {"steps": 10, "lr": 0.1}})
    first.close("FAILED")
    again = MlflowLogger(uri, art, "exp", "run", continue_run=first.run_id)
    assert again.run_id == first.run_id
    again.log_params({"train": {"steps": 20, "lr": 0.1}, "name": "run"})  # resume --set steps
    run = again.client.get_run(again.run_id)
    assert run.data.params == {"train.steps": "10", "train.lr": "0.1", "name": "run"}
    assert run.data.tags["resumed.train.steps"] == "20"
