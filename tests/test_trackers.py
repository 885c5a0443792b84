"""logging.trackers: metrics.jsonl as an Accelerate tracker, TensorBoard and MLflow through
Accelerate's trackers holding what metrics.jsonl holds (where their packages are installed), a
listed tracker without its package stops the run early, and the background writer every tracker
but metrics.jsonl is called from. W&B: tests/test_wandb.py."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, run_train

from zerotrain.train.config import load_config
from zerotrain.train.errors import ConfigError
from zerotrain.train.observe.metrics import JsonlTracker, Loggers


# ---------------------------------------------------------------------------- logging.trackers

def test_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError, match='logging.trackers jsonl,neptune: unknown tracker "neptune"; choose from '
                                          'jsonl, wandb, tensorboard, mlflow'):
        load_config(None, [("logging.trackers", "jsonl,neptune")])
    assert load_config(None, []).logging.trackers == ["jsonl", "wandb"]


def test_a_tracker_without_its_package_stops_the_run_before_the_model(tmp_path):
    """mlflow hidden from the run whether or not it is installed here: a sitecustomize sets
    sys.modules["mlflow"] = None, so importlib (and Accelerate's is_mlflow_available) finds none."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['mlflow'] = None\n")
    proc = run_train("python", 1, [*TINY, "--train.max_steps", "2", "--train.run_dir", str(tmp_path / "run"),
                                   "--logging.trackers", "jsonl,mlflow"], env={"PYTHONPATH": str(hide)},
                     check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "zerotrain: error: logging.trackers lists mlflow but its package is not installed; "
        "pip install mlflow, or drop it from logging.trackers")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _tracked_run(tmp_path, trackers: str):
    run_dir = tmp_path / "run"
    proc = run_train("python", 1, [*TINY, "--train.max_steps", "3", "--train.eval_every", "3",
                                   "--train.run_dir", str(run_dir), "--logging.trackers", trackers],
                     env={"MLFLOW_TRACKING_URI": ""}, timeout=300)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, proc, rows


@pytest.mark.multiproc
def test_tensorboard_tracker_holds_what_metrics_jsonl_holds(tmp_path):
    pytest.importorskip("tensorboard")
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir, proc, rows = _tracked_run(tmp_path, "jsonl,tensorboard")
    assert f"TensorBoard  {run_dir / 'tensorboard'}" in proc.stdout
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    for key in ("loss", "lr", "grad_norm", "val/loss"):
        logged = {r["step"]: r[key] for r in rows if key in r}
        assert logged and {e.step: e.value for e in events.Scalars(key)} == \
            {s: float(np.float32(v)) for s, v in logged.items()}, key  # TensorBoard keeps float32
    assert not (run_dir / "wandb").exists()  # not listed: no W&B run


@pytest.mark.multiproc
def test_mlflow_tracker_holds_what_metrics_jsonl_holds(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store back, as the run wrote it
    from mlflow.tracking import MlflowClient
    run_dir, proc, rows = _tracked_run(tmp_path, "jsonl,mlflow")
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    [exp] = [e for e in client.search_experiments() if e.name == "zerotrain"]
    [run] = client.search_runs([exp.experiment_id])  # one run, in the project's experiment
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert f"MLflow run   {run.info.run_id} in {(run_dir / 'mlruns').as_uri()}" in proc.stdout
    for key in ("loss", "lr", "grad_norm", "val/loss"):
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} == \
            {r["step"]: r[key] for r in rows if key in r}, key
    assert run.data.params["model/name"] == "gpt-tiny"


@pytest.mark.multiproc
def test_a_resumed_run_continues_its_mlflow_run_tensorboard_dir_and_metrics_jsonl(tmp_path, monkeypatch):
    """Trained 3 steps and saved, then resumed to 5 (--resume auto): one MLflow run (the same id,
    reopened) and one TensorBoard directory hold steps 1-5 as metrics.jsonl does, once each."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # reading the file store back, as the run wrote it
    import numpy as np
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir = tmp_path / "run"
    args = [*TINY, "--train.eval_every", "0", "--train.run_dir", str(run_dir),
            "--logging.trackers", "jsonl,tensorboard,mlflow", "--checkpoint.save_at_end", "true"]
    first = run_train("python", 1, [*args, "--train.max_steps", "3"], env={"MLFLOW_TRACKING_URI": ""}, timeout=300)
    again = run_train("python", 1, [*args, "--train.max_steps", "5", "--resume", "auto"],
                      env={"MLFLOW_TRACKING_URI": ""}, timeout=300)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    [exp] = [e for e in client.search_experiments() if e.name == "zerotrain"]
    [run] = client.search_runs([exp.experiment_id])  # one run, continued
    assert f"MLflow run   {run.info.run_id} in" in first.stdout
    assert f"MLflow run   {run.info.run_id} in" in again.stdout and "(resumed)" in again.stdout
    assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")} == losses
    assert run.info.status == "FINISHED"
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == \
        [(s, float(np.float32(v))) for s, v in losses.items()]  # TensorBoard keeps float32


# ---------------------------------------------------------------------------- the trackers' writer

class _Recorder:
    """A tracker that records its calls (and can block them)."""
    name, requires_logging_directory, tracker = "rec", False, None

    def __init__(self, gate=None, fail=False):
        self.calls, self.gate, self.broken = [], gate, fail

    def log(self, values, step=None):
        import threading
        if self.gate:
            self.gate.wait(30)
        if self.broken:
            raise RuntimeError("tracker broke")
        self.calls.append(("log", step, values["loss"], threading.current_thread().name))

    def fail(self):
        self.calls.append(("fail",))

    def finish(self):
        self.calls.append(("finish",))


def test_writer_calls_trackers_on_its_thread_in_order(tmp_path):
    """A log line costs the step no tracker work (issue 24): log() returns while the tracker's
    own call is still blocked; close() runs what is queued, in order, then finishes. metrics.jsonl
    is written on the caller's thread, as before."""
    import threading
    gate, slow = threading.Event(), None
    slow = _Recorder(gate)
    loggers = Loggers([JsonlTracker(tmp_path / "metrics.jsonl")])
    loggers.add(slow)
    metrics = {"loss": 1.0}
    loggers.log(metrics, 1)
    metrics["loss"] = 2.0  # the caller reuses its dict: the row keeps what was logged
    loggers.log(metrics, 2)
    assert slow.calls == [] and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    gate.set()
    loggers.close(failed=True)
    assert slow.calls == [("log", 1, 1.0, "zerotrain-trackers"), ("log", 2, 2.0, "zerotrain-trackers"),
                          ("fail",), ("finish",)]
    loggers.close()  # a second close finishes nothing twice
    assert slow.calls[-1] == ("finish",) and len(slow.calls) == 4


def test_writer_reraises_a_tracker_error_on_the_training_thread():
    loggers = Loggers([])
    loggers.add(_Recorder(fail=True))
    loggers.log({"loss": 1.0}, 1)
    with pytest.raises(RuntimeError, match="tracker broke"):
        loggers.close()


def test_jsonl_tracker_is_an_accelerate_tracker_writing_the_same_lines(tmp_path):
    from accelerate.tracking import GeneralTracker
    t = JsonlTracker(tmp_path / "m.jsonl")
    assert isinstance(t, GeneralTracker) and t.name == "jsonl"
    t.log({"loss": float("nan"), "lr": 0.5, "n": 3, "per_rank": [1, 2]}, step=7)
    t.finish()
    row = json.loads((tmp_path / "m.jsonl").read_text())
    assert list(row) == ["step", "time", "loss", "lr", "n", "per_rank"]
    assert (row["step"], row["loss"], row["lr"], row["n"], row["per_rank"]) == (7, "nan", 0.5, 3, [1, 2])
