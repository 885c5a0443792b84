"""The run's metric trackers (logging.trackers), Accelerate GeneralTrackers started on rank 0:

- jsonl:       <run_dir>/metrics.jsonl (metrics.JsonlTracker), opened before the checkpoint restore;
- wandb:       W&B (wandb_logger.py: its mode, credentials, resume of the same run id);
- tensorboard: Accelerate's TensorBoardTracker, event files in <run_dir>/tensorboard;
- mlflow:      Accelerate's MLflowTracker, experiment logging.wandb.project, run named after the
               run directory, in $MLFLOW_TRACKING_URI or else a local file store <run_dir>/mlruns.

A resume continues each: metrics.jsonl is appended to, TensorBoard writes a new event file in
the same directory (its readers merge them; the steps continue), and W&B and MLflow reopen the
run whose id the checkpoint's TrainState keeps.

preflight() runs before the model is built and start() at Trainer.start (after the checkpoint
restore, so W&B and MLflow resume the saved run ids); each ends in one broadcast from rank 0, so a rank-0
problem stops every rank with the same one-line error instead of leaving them in a collective.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from accelerate.tracking import MLflowTracker

from zerotrain.train.errors import ConfigError
from zerotrain.train.observe import wandb_logger
from zerotrain.train.observe.metrics import JsonlTracker, Loggers

NAMES = ("jsonl", "wandb", "tensorboard", "mlflow")
_PIP = {"tensorboard": "tensorboard", "mlflow": "mlflow"}


def missing(names) -> list[str]:
    """The trackers among `names` whose package is not installed (wandb: see wandb_logger)."""
    from accelerate.utils import is_mlflow_available, is_tensorboard_available
    have = {"tensorboard": is_tensorboard_available, "mlflow": is_mlflow_available}
    return [n for n in names if n in have and not have[n]()]


def _broadcast(values: list) -> list:
    from accelerate.utils import broadcast_object_list
    return broadcast_object_list(values, from_process=0)


def preflight(acc, cfg) -> None:
    """Before the model is built, on every rank: exit 2 (ConfigError) when a tracker cannot run."""
    problem = None
    if acc.is_main_process:
        try:
            gone = missing(cfg.logging.trackers)
            if gone:
                problem = (f"logging.trackers lists {', '.join(gone)} but its package is not installed; "
                           f"pip install {' '.join(_PIP[n] for n in gone)}, or drop it from logging.trackers")
            elif "wandb" in cfg.logging.trackers:
                problem = wandb_logger.problem(cfg)
        except ConfigError as e:
            problem = str(e)
    problem = _broadcast([problem])[0]
    if problem:
        raise ConfigError(problem)


def jsonl(acc, cfg, run_dir: Path) -> Loggers:
    """The Loggers every run has from its start: metrics.jsonl on rank 0 when listed, else empty."""
    want = acc.is_main_process and "jsonl" in cfg.logging.trackers
    return Loggers([JsonlTracker(Path(run_dir) / "metrics.jsonl")] if want else [])


def start(acc, cfg, loggers: Loggers, run_id: Optional[str], run_dir: Path, config: dict,
          mlflow_id: Optional[str] = None):
    """Start the listed trackers but jsonl on rank 0 and add them to `loggers`. Returns (the W&B
    tracker on rank 0 or None; rank 0's start-up lines; the W&B run id and the MLflow run id
    every rank keeps in its TrainState, which checkpoints save). `run_id` / `mlflow_id`: the
    saved ids of a resumed run, whose runs continue."""
    wandb, lines, problem = None, [], None
    names = cfg.logging.trackers
    if acc.is_main_process:
        try:
            if "wandb" in names:
                wandb, line = wandb_logger.start(cfg, run_id, run_dir, config)
                lines.append(line)
                if wandb:
                    loggers.add(wandb)
                    run_id = wandb.run.id
            flat = _flat(config)
            if "tensorboard" in names:
                from accelerate.tracking import TensorBoardTracker
                tb = TensorBoardTracker("tensorboard", run_dir)
                loggers.add(tb, lambda: _started(tb, flat))
                lines.append(f"TensorBoard  {Path(run_dir) / 'tensorboard'}  (view: tensorboard --logdir {run_dir})")
            if "mlflow" in names:
                line, mlflow_id = _mlflow(cfg, loggers, run_dir, flat, mlflow_id)
                lines.append(line)
        except Exception as e:  # a tracker that cannot start: one line on every rank
            problem = str(e) if isinstance(e, ConfigError) else \
                f"logging.trackers: a tracker could not start ({type(e).__name__}: {wandb_logger._oneline(e)})"
    problem, run_id, mlflow_id = _broadcast([problem, run_id, mlflow_id])
    if problem:
        raise ConfigError(problem)  # Trainer.close() still finishes what did start
    return wandb, lines, run_id, mlflow_id


def _started(tracker, config: dict):
    tracker.start()
    tracker.store_init_configuration(config)
    return tracker


class _MLflow(MLflowTracker):
    def log(self, values: dict, step: Optional[int] = None, **kwargs):
        """MLflow metrics are numbers: the per-rank lists and text stay in metrics.jsonl / W&B."""
        super().log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=step, **kwargs)


def _mlflow(cfg, loggers: Loggers, run_dir: Path, config: dict, run_id: Optional[str]) -> tuple[str, str]:
    """(the banner's line, the run id). `run_id`: a resumed run's MLflow run, reopened (its
    params stay those of its first start: MLflow refuses a param logged again with another
    value, and a resume may change some, the world size among them)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or (Path(run_dir) / "mlruns").resolve().as_uri()
    tracker = _MLflow(experiment_name=cfg.logging.wandb.project, run_name=Path(run_dir).name, run_id=run_id)

    def start():
        import mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3.x refuses its file store (in maintenance) unless asked: the run dir is asking.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri(uri)
        if run_id is None:
            _started(tracker, config)
        else:
            tracker.start()
    loggers.add(tracker, start)  # on the writer thread: MLflow's active run belongs to the thread that started it
    got = tracker.active_run.info.run_id
    return f"MLflow run   {got} in {uri}" + (" (resumed)" if run_id else ""), got


def _flat(config: dict, prefix: str = "") -> dict:
    """The run config as TensorBoard's hparams and MLflow's params take it: one level of
    "a/b/c" keys, scalar values; lists and None as JSON text."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    return out
