"""W&B logging: one offline run per training, read back from its .wandb file (no network),
matching metrics.jsonl and carrying the resolved config; resume continues the run id;
mode selection; online without credentials fails early; the API key never leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_train, test_env, train_losses
from wandb_offline import (FAKE_API_KEY, iter_payloads, observed_run, read_run, run_files,
                           wandb_env)

from train.errors import ConfigError
from train.wandb_logger import resolve_mode


# ---------------------------------------------------------------------------- the real 2-process run

@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    return observed_run(tmp_path_factory)


@pytest.mark.multiproc
def test_offline_run_matches_metrics_jsonl_and_holds_the_resolved_config(observed):
    run_dir, proc, _, _ = observed
    files = run_files(run_dir / "wandb")
    assert len(files) == 1, f"expected exactly one W&B run for one training (2 ranks), got {files}"
    run = read_run(files[0])
    assert len(run.run_ids) == 1 and files[0].name == f"run-{run.run_ids[0]}.wandb"
    assert (run.project, run.name, run.tags, run.group) == ("zt-test", run_dir.name, ["ci", "zero2"], "obs")
    assert run.exit_code == 0

    # Every logged training loss reached W&B, at the same step, bit-for-bit.
    jsonl = train_losses(run_dir)
    wb = {row["_step"]: row["loss"] for row in run.history if "loss" in row}
    assert len(jsonl) == 6 and wb == jsonl
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"]: r["val/loss"] for r in rows if "val/loss" in r} == \
        {row["_step"]: row["val/loss"] for row in run.history if "val/loss" in row}
    for key in ("lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes", "data_wait_s"):
        assert [r[key] for r in rows if key in r] == [h[key] for h in run.history if key in h], key

    # The fully resolved config: run file + DeepSpeed JSON + world size + versions + commit.
    resolved = json.loads((run_dir / "config.json").read_text())
    cfg = run.config
    assert cfg["resolved"]["world_size"] == 2 and cfg["resolved"]["zero_stage"] == 2
    assert cfg["resolved"]["deepspeed_config"]["zero_optimization"]["stage"] == 2
    assert cfg["resolved"]["versions"] == resolved["resolved"]["versions"]
    assert cfg["resolved"]["git_commit"] == resolved["resolved"]["git_commit"]
    assert cfg["logging"]["wandb"]["mode"] == "offline" and cfg["model"]["name"] == "gpt-tiny"
    assert cfg["train"]["global_batch_size"] == 8

    # Only rank 0 started W&B: one run dir, and the id is what a checkpoint would store.
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 1
    assert f"run {run.run_ids[0]}" in proc.stdout  # banner


@pytest.mark.multiproc
def test_api_key_never_printed_or_stored(observed):
    run_dir, proc, _, env = observed
    assert FAKE_API_KEY not in proc.stdout + proc.stderr
    for path in [*run_dir.rglob("*"), *Path(env["WANDB_CONFIG_DIR"]).parent.rglob("*")]:
        if path.is_file():
            assert FAKE_API_KEY.encode() not in path.read_bytes(), path


@pytest.mark.multiproc
def test_reader_stops_cleanly_at_a_torn_tail(observed):
    run_dir = observed[0]
    data = run_files(run_dir / "wandb")[0].read_bytes()
    full = list(iter_payloads(data))
    for cut in range(7, len(data), 97):
        got = list(iter_payloads(data[:cut]))
        assert got == full[:len(got)]  # a prefix, never garbage, never an exception


@pytest.mark.multiproc
@pytest.mark.skipif(not (REPO / "train" / "checkpoint.py").exists(), reason="needs the checkpoint module (issue: "
                    "checkpoints) to restore TrainState.wandb_run_id with --resume auto")
def test_resumed_training_continues_the_same_wandb_run(observed, tmp_path):
    import shutil
    # Resume a copy: the shared run stays as other tests expect it.
    run_dir = tmp_path / "run"
    shutil.copytree(observed[0], run_dir, symlinks=True)
    _, _, args, env = observed
    first = read_run(run_files(run_dir / "wandb")[0]).run_ids[0]
    run_train("deepspeed", 2, [*args, "--train.run_dir", str(run_dir), "--resume", "auto", "--train.max_steps", "9"],
              env=env, timeout=900)
    files = run_files(run_dir / "wandb")
    assert len(files) == 2  # offline resume writes a second file for the same run id
    runs = [read_run(f) for f in files]
    assert {r.run_ids[0] for r in runs} == {first}
    second = next(r for r in runs if any(h.get("_step", 0) > 6 for h in r.history))
    steps = sorted(h["_step"] for h in second.history if "loss" in h)
    assert steps == [7, 8, 9]
    assert {h["_step"]: h["loss"] for h in second.history if "loss" in h} == \
        {s: v for s, v in train_losses(run_dir).items() if s > 6}
    assert len(train_losses(run_dir)) == 9  # metrics.jsonl continues too


# ---------------------------------------------------------------------------- resume plumbing (1 process)

_START_TWICE = r"""
import json, sys
from pathlib import Path
from types import SimpleNamespace
from accelerate import Accelerator
from train.config import load_config
from train.trainer import TrainState
from train import wandb_logger

run_dir = Path(sys.argv[1])
cfg = load_config(None, [("logging.wandb.mode", "offline"), ("logging.wandb.project", "resume-test")])
saved_id, ids = None, []
for first_step in (0, 3):  # a training to step 3, then its resume from a checkpoint holding saved_id
    acc = Accelerator(cpu=True, log_with=wandb_logger.log_with(cfg))
    t = SimpleNamespace(acc=acc, cfg=cfg, state=TrainState(step=first_step, wandb_run_id=saved_id),
                        run_dir=run_dir, resolved_config={"model": {"name": "x"}, "big": "z" * 70_000})
    sink = wandb_logger.start(t)
    for step in range(first_step + 1, first_step + 4):
        sink.log({"loss": 1.0 / step}, step)
    if first_step:
        sink.mark_preempting()  # the resumed session is stopped by SIGTERM (Trainer.finish)
    sink.close()
    acc.end_training()
    ids.append(sink.run.id)
    saved_id = t.state.wandb_run_id  # what the checkpoint stores
    assert saved_id == sink.run.id
print(json.dumps(ids))
"""


def test_start_resumes_the_run_id_kept_in_train_state(tmp_path):
    """What a resumed training does: TrainState.wandb_run_id (from the checkpoint) goes back
    to wandb with resume="allow"; the new id is stored in the state for the next checkpoint."""
    env = test_env({**wandb_env(tmp_path / "home"), "PYTHONPATH": str(REPO)})
    out = subprocess.run([sys.executable, "-c", _START_TWICE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = json.loads(out.stdout.strip().splitlines()[-1])
    assert first == second and len(first) == 8
    runs = [read_run(f) for f in run_files(tmp_path / "wandb")]
    assert [r.run_ids for r in runs] == [[first], [first]]
    assert [[h["_step"] for h in r.history] for r in runs] == [[1, 2, 3], [4, 5, 6]]
    # A 70 kB config record spans three 32 KiB blocks (first / middle / last fragments).
    assert all(r.config["big"] == "z" * 70_000 and r.config["model"] == {"name": "x"} for r in runs)
    data = run_files(tmp_path / "wandb")[0].read_bytes()
    full = list(iter_payloads(data))
    for cut in [*range(7, len(data), 1009), 32 * 1024, 32 * 1024 + 3, 64 * 1024 + 11]:
        got = list(iter_payloads(data[:cut]))
        assert got == full[:len(got)]  # torn anywhere: a clean prefix, never garbage or an exception
    # First session finished normally; the second was stopped by a signal: W&B must see
    # "preempted" (mark_preempting + non-zero exit), not "finished" and not "crashed".
    assert [(r.preempting, r.exit_code) for r in runs] == [(False, 0), (True, 1)]


_START_UNREACHABLE = r"""
import sys
from pathlib import Path
from types import SimpleNamespace
from accelerate import Accelerator
from train.config import load_config
from train.errors import ConfigError
from train.trainer import TrainState
from train import wandb_logger

cfg = load_config(None, [("logging.wandb.mode", "online")])
acc = Accelerator(cpu=True, log_with=wandb_logger.log_with(cfg))
t = SimpleNamespace(acc=acc, cfg=cfg, state=TrainState(), run_dir=Path(sys.argv[1]), resolved_config={})
try:
    wandb_logger.start(t)
    sys.exit("no error")
except ConfigError as e:
    print("ERROR:", e)
acc.end_training()  # the failed tracker must not break clean-up (it would hide the message)
print("clean exit")
"""


def test_online_with_unreachable_server_is_one_clear_error(tmp_path):
    """A key but no reachable server: wandb.init times out; the user gets one message with the
    fix (never the key), and clean-up still works."""
    env = test_env({**wandb_env(tmp_path / "home"), "PYTHONPATH": str(REPO), "WANDB_MODE": "online",
                    "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_INIT_TIMEOUT": "3", "WANDB_SILENT": "true"})
    out = subprocess.run([sys.executable, "-c", _START_UNREACHABLE, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ERROR: W&B could not start the run" in out.stdout and "--logging.wandb.mode offline" in out.stdout
    assert out.stdout.rstrip().endswith("clean exit")
    assert FAKE_API_KEY not in out.stdout + out.stderr


# ---------------------------------------------------------------------------- modes and credentials

@pytest.mark.parametrize("configured, env, expected", [
    (None, {}, "disabled"),
    (None, {"WANDB_MODE": "offline"}, "offline"),
    (None, {"WANDB_MODE": "ONLINE"}, "online"),
    (None, {"WANDB_MODE": "dryrun"}, "offline"),
    ("offline", {"WANDB_MODE": "disabled"}, "offline"),   # the run's own setting wins
    ("disabled", {"WANDB_MODE": "online"}, "disabled"),
])
def test_mode_resolution(configured, env, expected):
    assert resolve_mode(configured, env) == expected


def test_bad_wandb_mode_env_names_the_variable():
    with pytest.raises(ConfigError, match='WANDB_MODE="sometimes".*--logging.wandb.mode'):
        resolve_mode(None, {"WANDB_MODE": "sometimes"})


def test_online_without_credentials_fails_early_with_a_fix(tmp_path):
    """No key anywhere (env, netrc, wandb settings): exit 2 before any training step, saying
    how to log in, instead of prompting / hanging."""
    home = tmp_path / "home"
    env = {**wandb_env(home), "HOME": str(home), "NETRC": str(home / "no-netrc"), "WANDB_MODE": "online",
           "WANDB_API_KEY": "", "WANDB_IDENTITY_TOKEN_FILE": ""}
    proc = run_train("python", 1, [*TINY, "--train.max_steps", "2", "--train.run_dir", str(tmp_path / "run")],
                     env=env, check=False, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "zerotrain: error: logging.wandb.mode is online but W&B has no API key" in proc.stderr
    assert "wandb login" in proc.stderr and "--logging.wandb.mode offline" in proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert "Traceback" not in proc.stderr
