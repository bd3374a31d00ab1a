"""run.loggers: TensorBoard, W&B (offline) and MLflow (a local SQLite store) record the same
metric names and values as metrics.jsonl, read back through each one's own format; sample
tables; train.log; a missing extra and a failing sink."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from sink_readers import tensorboard_scalars, tensorboard_texts, wandb_history

from tidal.config import load_config
from tidal.runtime.controller import Controller

pytest.importorskip("wandb")  # the dev extra installs all three; a bare install skips, never fakes
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")

STEPS = 3


def jsonl_values(run_dir) -> dict[int, dict[str, float]]:
    """step → the numeric, non-null values of metrics.jsonl (what every sink must hold)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = row.pop("step")
        out[step] = {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and v is not None}
    return out


@pytest.fixture(scope="module")
def run_with_every_sink(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sinks")
    run_dir = tmp / "run"
    cfg = load_config(None, [
        f"run.dir={run_dir}", f"train.steps={STEPS}", "rollout.prompts_per_step=4", "rollout.samples_per_prompt=4",
        "run.eval_every=2", "eval.n=16", "run.progress=false", "run.save_every=0",
        "run.loggers=[console,jsonl,tensorboard,wandb,mlflow]", "run.wandb_mode=offline",
        f"run.mlflow_tracking_uri=sqlite:///{tmp / 'mlflow.db'}", "run.log_samples=3", "run.log_samples_every=2"])
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)  # MLflow puts a local store's artifacts in ./mlruns
        ctl = Controller(cfg)
        try:
            ctl.train()
        finally:
            ctl.close()
    return run_dir, cfg


def test_tensorboard_holds_the_jsonl_values(run_with_every_sink):
    run_dir, _ = run_with_every_sink
    expected = jsonl_values(run_dir)
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert set(scalars) == {k for row in expected.values() for k in row}
    for step, row in expected.items():
        for key, value in row.items():
            # TensorBoard stores a scalar as float32: exactly the float32 nearest the value.
            assert scalars[key][step] == float(np.float32(value)), (key, step)
    text = tensorboard_texts(run_dir / "tensorboard")
    assert set(text) == {2}  # log_samples_every=2 within 3 steps
    assert text[2].count("\n| 2 |") == 3 and "| episode |" in text[2]


def test_wandb_offline_run_holds_the_jsonl_values(run_with_every_sink):
    run_dir, _ = run_with_every_sink
    expected = jsonl_values(run_dir)
    history = wandb_history(run_dir)
    assert set(history) == set(expected)
    for step, row in expected.items():
        logged = {k: v for k, v in history[step].items() if not k.startswith(("_", "samples/"))}
        assert logged == row, step  # JSON doubles: exact
    table = history[2]
    assert table["samples/_type"] == "table-file" and table["samples/nrows"] == 3


def test_mlflow_run_holds_the_jsonl_values(run_with_every_sink):
    from mlflow.tracking import MlflowClient

    run_dir, cfg = run_with_every_sink
    expected = jsonl_values(run_dir)
    run_id = json.loads((run_dir / "sinks.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=cfg.run.mlflow_tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    keys = {k for row in expected.values() for k in row}
    assert set(run.data.metrics) == keys
    for key in keys:
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == {step: row[key] for step, row in expected.items() if key in row}, key
    table = json.loads(_artifact(client, run_id, "samples/step_000002.json", run_dir.parent))
    assert table["columns"][:4] == ["step", "episode", "status", "reward"] and len(table["data"]) == 3
    config = json.loads(_artifact(client, run_id, "config.json", run_dir.parent))
    assert config["train"]["steps"] == STEPS


def _artifact(client, run_id: str, path: str, into: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(into))).read_text()


def test_console_lines_and_samples_are_in_train_log(run_with_every_sink):
    run_dir, _ = run_with_every_sink
    log = (run_dir / "train.log").read_text()
    expected = jsonl_values(run_dir)
    for step in range(1, STEPS + 1):
        assert f"step {step}/{STEPS}  reward {expected[step]['reward']:.3f}" in log
    assert "samples of step 2:" in log and "samples of step 1:" not in log
    assert log.count("  episode: s2-") == 3


def test_a_missing_extra_is_named_when_the_config_loads(monkeypatch):
    import importlib.util  # what config (tidal/config/run.py) asks whether a sink's package is installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ValueError, match=r"run\.loggers.*wandb needs the `wandb` package: pip install 'tidal\[wandb\]'"):
        load_config(None, ["run.loggers=[console,wandb]"])
    load_config(None, ["run.loggers=[console,tensorboard]"])  # the others still load


def test_a_failing_sink_is_named_once_and_the_run_goes_on(tmp_path, caplog):
    from tidal.monitor.sinks import JsonlSink, Sinks

    class BrokenService:  # a sink whose service went away
        name = "wandb"
        closed = False

        def log(self, step, metrics):
            raise ConnectionError("api.wandb.ai unreachable")

        def table(self, step, columns, rows):
            raise AssertionError("not called after it failed")

        def close(self):
            self.closed = True

    broken = BrokenService()
    sinks = Sinks([JsonlSink(tmp_path / "metrics.jsonl"), broken])
    with caplog.at_level(logging.WARNING, logger="tidal"):
        for step in (1, 2):
            sinks.log(step, {"reward": 0.5, "nan": float("nan")})
        sinks.table(2, ["a"], [[1]])
    sinks.close()
    failures = [r for r in caplog.records if "wandb failed at step 1" in r.getMessage()]
    assert len(failures) == 1 and "ConnectionError: api.wandb.ai unreachable" in failures[0].getMessage()
    assert broken.closed
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "reward": 0.5, "nan": None}, {"step": 2, "reward": 0.5, "nan": None}]


def test_a_resumed_run_continues_its_mlflow_run_and_tensorboard_shows_each_step_once(tmp_path, monkeypatch):
    """A run that lost its last checkpoint (as a crash after step 3's metrics but before its
    save would) resumes from step 2: step 3 is logged again, into the same MLflow run."""
    import shutil

    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)  # MLflow puts a local store's artifacts in ./mlruns
    run_dir, uri = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"
    common = [f"run.dir={run_dir}", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4", "run.eval_every=0",
              "run.progress=false", "run.loggers=[jsonl,tensorboard,mlflow]", f"run.mlflow_tracking_uri={uri}",
              "run.save_every=2", "train.steps=3"]
    for resume in (False, True):
        ctl = Controller(load_config(None, common), resume=resume)
        try:
            ctl.train()
        finally:
            ctl.close()
        shutil.rmtree(run_dir / "checkpoints" / "step_000003", ignore_errors=True)
    expected = jsonl_values(run_dir)
    assert sorted(expected) == [1, 2, 3]
    run_id = json.loads((run_dir / "sinks.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=uri)
    assert len(client.search_runs([client.get_experiment_by_name("tidal").experiment_id])) == 1
    history = client.get_metric_history(run_id, "reward")
    # MLflow keeps every value logged: step 3 twice (the same value: resume is exact).
    assert sorted(m.step for m in history) == [1, 2, 3, 3]
    assert {m.step: m.value for m in history} == {s: row["reward"] for s, row in expected.items()}
    scalars = tensorboard_scalars(run_dir / "tensorboard")["reward"]
    assert scalars == {s: float(np.float32(row["reward"])) for s, row in expected.items()}
