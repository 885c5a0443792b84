"""W&B logging: one offline run per training, read back from its .wandb file (no network),
matching metrics.jsonl and carrying the resolved config; resume continues the run id;
mode selection (auto: online with credentials, offline without, the env's WANDB_MODE /
WANDB_DISABLED); credential detection; online without credentials fails early; the API key
never leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY, run_train, subprocess_env, train_losses
from wandb_offline import (FAKE_API_KEY, iter_payloads, observed_run, read_run, run_files,
                           wandb_env)

from zerotrain.train.errors import ConfigError
from zerotrain.train.observe.wandb_logger import choose, credential_source, resolve_mode


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
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and offline[0].name.endswith(f"-{run.run_ids[0]}")
    # The start-up line says where the run went and how to upload it (no note: the mode was asked for).
    assert f"\n  W&B offline run in {offline[0]}; upload with: wandb sync {offline[0]}\n" in proc.stdout


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
def test_resumed_training_continues_the_same_wandb_run(observed, tmp_path):
    import shutil
    # Resume a copy: the shared run stays as other tests expect it.
    run_dir = tmp_path / "run"
    shutil.copytree(observed[0], run_dir, symlinks=True)
    _, _, args, env = observed
    first = read_run(run_files(run_dir / "wandb")[0]).run_ids[0]
    # The run id lives in the checkpoint: resuming continues the same W&B run.
    run_train("torchrun", 2, [*args, "--train.run_dir", str(run_dir), "--resume", "auto", "--train.max_steps", "9"],
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
from accelerate import Accelerator
from zerotrain.train.config import load_config
from zerotrain.train.checkpoint.state import TrainState
from zerotrain.train.observe import wandb_logger

run_dir = Path(sys.argv[1])
cfg = load_config(None, [("logging.wandb.mode", "offline"), ("logging.wandb.project", "resume-test")])
saved_id, ids = None, []
for first_step in (0, 3):  # a training to step 3, then its resume from a checkpoint holding saved_id
    acc = Accelerator(cpu=True, log_with=wandb_logger.log_with(cfg))
    state = TrainState(step=first_step, wandb_run_id=saved_id)
    sink, _, state.wandb_run_id = wandb_logger.start(acc, cfg, state.wandb_run_id, run_dir,
                                                     {"model": {"name": "x"}, "big": "z" * 70_000})
    for step in range(first_step + 1, first_step + 4):
        sink.log({"loss": 1.0 / step}, step)
    if first_step:
        sink.mark_preempting()  # the resumed session is stopped by SIGTERM (Trainer.finish)
    sink.close()
    acc.end_training()
    ids.append(sink.run.id)
    saved_id = state.wandb_run_id  # what the checkpoint stores
    assert saved_id == sink.run.id
print(json.dumps(ids))
"""


def test_start_resumes_the_run_id_kept_in_train_state(tmp_path):
    """What a resumed training does: TrainState.wandb_run_id (from the checkpoint) goes back
    to wandb with resume="allow"; the new id is stored in the state for the next checkpoint."""
    env = subprocess_env({**wandb_env(tmp_path / "home"), "PYTHONPATH": str(REPO)})
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


_START_CASES = r"""
import os, sys
from pathlib import Path
from accelerate import Accelerator
from zerotrain.train.config import load_config
from zerotrain.train.errors import ConfigError
from zerotrain.train.checkpoint.state import TrainState
from zerotrain.train.observe import wandb_logger

def start(mode, run_dir, **env):
    os.environ.update(env)
    if not os.environ.get("WANDB_MODE"):
        os.environ.pop("WANDB_MODE", None)
    cfg = load_config(None, [("logging.wandb.mode", mode)])
    acc = Accelerator(cpu=True, log_with=wandb_logger.log_with(cfg))
    state = TrainState()
    try:
        sink, status, state.wandb_run_id = wandb_logger.start(acc, cfg, state.wandb_run_id, Path(run_dir), {})
        print("STATUS:", status)
        print("ID:", state.wandb_run_id)
        if sink:
            sink.log({"loss": 1.0}, 1)
            sink.close()
    except ConfigError as e:
        print("ERROR:", e)
    acc.end_training()  # a failed tracker must not break clean-up (it would hide the message)
    print("IMPORTED:", "wandb" in sys.modules)
    print("clean exit")

base = Path(sys.argv[1])
# auto with WANDB_MODE=disabled (a key set): nothing written, wandb never imported.
start("auto", base / "disabled", WANDB_MODE="disabled")
# A key but no reachable server: wandb.init times out.
unreachable = dict(WANDB_MODE="", WANDB_BASE_URL="http://127.0.0.1:9", WANDB_INIT_TIMEOUT="3")
start("online", base / "online", **unreachable)  # asked for online: one error
start("auto", base / "auto", **unreachable)      # auto chose online: an offline run instead
"""


@pytest.fixture(scope="module")
def start_cases(tmp_path_factory):
    base = tmp_path_factory.mktemp("start")
    env = subprocess_env({**wandb_env(base / "home"), "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"})
    out = subprocess.run([sys.executable, "-c", _START_CASES, str(base)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    cases = out.stdout.split("clean exit\n")
    assert len(cases) == 4 and FAKE_API_KEY not in out.stdout + out.stderr, out.stdout + out.stderr[-3000:]
    return base, cases


def test_auto_with_wandb_mode_disabled_writes_nothing(start_cases):
    base, (disabled, *_) = start_cases
    assert "STATUS: W&B disabled (WANDB_MODE=disabled)" in disabled
    assert "IMPORTED: False" in disabled and not (base / "disabled").exists()


def test_online_with_unreachable_server_is_one_clear_error(start_cases):
    """A key but no reachable server: wandb.init times out; the user gets one message with the
    fix (never the key), and clean-up still works."""
    online = start_cases[1][1]
    error = next(line for line in online.splitlines() if line.startswith("ERROR: "))
    assert error.startswith("ERROR: W&B could not start the run") and "--logging.wandb.mode offline" in error


def test_auto_falls_back_to_an_offline_run_when_online_cannot_start(start_cases):
    """auto chose online (a key is set) but the server is unreachable: the training goes on
    with an offline run, the line says why, and the state (hence checkpoints) holds its id."""
    base, auto = start_cases[0], start_cases[1][2]
    files = run_files(base / "auto" / "wandb")
    assert len(files) == 1
    run = read_run(files[0])
    assert run.history[0]["loss"] == 1.0 and f"ID: {run.run_ids[0]}\n" in auto
    sync_dir = files[0].parent
    assert f"STATUS: W&B offline run in {sync_dir}; upload with: wandb sync {sync_dir}  (auto: online failed" in auto


# ---------------------------------------------------------------------------- modes and credentials

@pytest.mark.parametrize("configured, env, expected", [
    (None, {"WANDB_MODE": "offline"}, "offline"),
    ("auto", {"WANDB_MODE": "ONLINE"}, "online"),
    ("auto", {"WANDB_MODE": "dryrun"}, "offline"),
    ("auto", {"WANDB_MODE": "disabled", "WANDB_API_KEY": FAKE_API_KEY}, "disabled"),
    ("auto", {"WANDB_DISABLED": "true", "WANDB_MODE": "online"}, "disabled"),  # transformers' switch
    ("offline", {"WANDB_MODE": "disabled"}, "offline"),   # the run's own setting wins
    ("disabled", {"WANDB_MODE": "online"}, "disabled"),
    ("online", {"WANDB_DISABLED": "true"}, "online"),
])
def test_mode_resolution(configured, env, expected):
    assert resolve_mode(configured, env) == expected


def _no_credentials(home: Path) -> dict:
    """An environment whose only W&B sources are files under `home` (none yet)."""
    return {"HOME": str(home), "WANDB_CONFIG_DIR": str(home / ".config" / "wandb")}


def test_auto_is_online_with_credentials_offline_without_and_off_without_the_package(tmp_path):
    env, cwd = _no_credentials(tmp_path), tmp_path / "cwd"
    got = choose("auto", env, cwd, have_wandb=True)
    assert (got.mode, got.requested) == ("offline", False) and "wandb login" in got.reason
    assert choose(None, env, cwd, have_wandb=True) == got  # null in a run file = auto
    got = choose("auto", {**env, "WANDB_API_KEY": FAKE_API_KEY}, cwd, have_wandb=True)
    assert (got.mode, got.reason, got.requested) == ("online", "credentials from WANDB_API_KEY", False)
    got = choose("auto", {**env, "WANDB_API_KEY": FAKE_API_KEY}, cwd, have_wandb=False)
    assert (got.mode, got.requested) == ("disabled", False) and "not installed" in got.reason
    # `wandb offline` / `wandb disabled` write mode into ./wandb/settings: honoured by auto.
    (cwd / "wandb").mkdir(parents=True)
    (cwd / "wandb" / "settings").write_text("[default]\nmode = offline\n")
    got = choose("auto", {**env, "WANDB_API_KEY": FAKE_API_KEY}, cwd, have_wandb=True)
    assert (got.mode, got.requested, got.reason) == ("offline", True, f"mode = offline in {cwd / 'wandb' / 'settings'}")
    assert choose("auto", {**env, "WANDB_MODE": "online"}, cwd).mode == "online"  # the env var wins over it
    assert all(FAKE_API_KEY not in c.reason for c in (got, choose("auto", {**env, "WANDB_API_KEY": FAKE_API_KEY})))


def _netrc(path: Path, host: str, password: str = FAKE_API_KEY) -> Path:
    path.write_text(f"machine {host}\n  login user\n  password {password}\n")
    path.chmod(0o600)
    return path


def test_credential_source_reads_what_wandb_login_writes(tmp_path):
    home = tmp_path / "home"
    (home / ".config" / "wandb").mkdir(parents=True)
    env, cwd = _no_credentials(home), tmp_path
    assert credential_source(env, cwd) is None
    assert credential_source({**env, "WANDB_API_KEY": FAKE_API_KEY}, cwd) == "WANDB_API_KEY"
    assert credential_source({**env, "WANDB_API_KEY": ""}, cwd) is None  # set but empty: no key

    # ~/.netrc from `wandb login`: a password for api.wandb.ai; another host's entry is no W&B key.
    _netrc(home / ".netrc", "github.com")
    assert credential_source(env, cwd) is None
    _netrc(home / ".netrc", "api.wandb.ai")
    assert credential_source(env, cwd) == "~/.netrc"
    _netrc(home / ".netrc", "api.forge.coreweave.com")  # wandb 0.31's default server
    assert credential_source(env, cwd) == "~/.netrc"
    _netrc(home / ".netrc", "api.wandb.ai", password='""')
    assert credential_source(env, cwd) is None  # an entry without a key (wandb ignores it too)

    # A self-hosted server ($WANDB_BASE_URL, or base_url in wandb's settings): its host's entry counts.
    _netrc(home / ".netrc", "wandb.example.com:8080")
    assert credential_source(env, cwd) is None
    assert credential_source({**env, "WANDB_BASE_URL": "https://wandb.example.com:8080"}, cwd) == "~/.netrc"
    (home / ".config" / "wandb" / "settings").write_text("[default]\nbase_url = https://wandb.example.com:8080\n")
    assert credential_source(env, cwd) == "~/.netrc"

    # $NETRC names another file; a malformed file is ignored, as wandb does.
    elsewhere = _netrc(tmp_path / "netrc", "api.wandb.ai")
    (home / ".config" / "wandb" / "settings").unlink()
    assert credential_source({**env, "NETRC": str(elsewhere)}, cwd) == str(elsewhere)
    elsewhere.write_text("machine\n")
    assert credential_source({**env, "NETRC": str(elsewhere)}, cwd) is None
    # An api_key in wandb's settings file.
    (home / ".config" / "wandb" / "settings").write_text(f"[default]\napi_key = {FAKE_API_KEY}\n")
    assert credential_source(env, cwd) == "wandb settings"


def test_bad_wandb_mode_env_names_the_variable():
    with pytest.raises(ConfigError, match='WANDB_MODE="sometimes".*--logging.wandb.mode'):
        resolve_mode(None, {"WANDB_MODE": "sometimes"})


@pytest.mark.multiproc
def test_auto_without_credentials_writes_an_offline_run_and_says_how_to_upload(tmp_path):
    """The default (logging.wandb.mode auto) on a machine without W&B credentials: the metrics
    still reach W&B, as an offline run in the run directory, and the start-up line gives the
    `wandb sync` command."""
    home, run_dir = tmp_path / "home", tmp_path / "run"
    # An empty WANDB_* variable counts as unset (tests/helpers.py's subprocess_env sets WANDB_MODE).
    env = {**wandb_env(home), "HOME": str(home), "NETRC": str(home / "no-netrc"), "WANDB_MODE": "",
           "WANDB_API_KEY": "", "WANDB_IDENTITY_TOKEN_FILE": "", "WANDB_DISABLED": "", "WANDB_SILENT": ""}
    proc = run_train("python", 1, [*TINY, "--train.max_steps", "3", "--train.eval_every", "0",
                                   "--train.run_dir", str(run_dir)], env=env, timeout=300)
    files = run_files(run_dir / "wandb")
    assert len(files) == 1, proc.stdout[-3000:]
    run = read_run(files[0])
    assert {row["_step"]: row["loss"] for row in run.history if "loss" in row} == train_losses(run_dir)
    assert run.exit_code == 0 and run.config["logging"]["wandb"]["mode"] == "auto"
    sync_dir = files[0].parent
    line = next(x for x in proc.stdout.splitlines() if "W&B" in x)
    assert line == (f"  W&B offline run in {sync_dir}; upload with: wandb sync {sync_dir}  "
                    f"(auto: no W&B credentials; `wandb login` or WANDB_API_KEY to log online)")
    assert "Run history:" not in proc.stdout  # wandb's own footer stays quiet


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


# ---------------------------------------------------------------------------- off the step's critical path

def test_sink_calls_wandb_on_a_writer_thread_in_order():
    """A log line costs the step no wandb work (issue 24): log() returns while the tracker's
    own call is still blocked; close() runs what is queued, in order, then finishes the run."""
    import threading
    from types import SimpleNamespace

    from zerotrain.train.observe.wandb_logger import WandbSink
    gate, calls = threading.Event(), []

    class Acc:
        def log(self, metrics, step):
            gate.wait(30)
            calls.append(("log", step, metrics["loss"], threading.current_thread().name))

    run = SimpleNamespace(settings=SimpleNamespace(mode="offline"), summary={},
                          finish=lambda exit_code: calls.append(("finish", exit_code)))
    sink = WandbSink(Acc(), run)
    metrics = {"loss": 1.0}
    sink.log(metrics, 1)
    metrics["loss"] = 2.0  # the caller reuses its dict: the row keeps what was logged
    sink.log(metrics, 2)
    assert calls == []  # both returned with the tracker still blocked
    gate.set()
    sink.close()
    assert calls == [("log", 1, 1.0, "zerotrain-wandb"), ("log", 2, 2.0, "zerotrain-wandb"), ("finish", 0)]


def test_sink_reraises_a_writer_error_on_the_training_thread():
    from types import SimpleNamespace

    from zerotrain.train.observe.wandb_logger import WandbSink

    class Acc:
        def log(self, metrics, step):
            raise RuntimeError("wandb broke")

    run = SimpleNamespace(settings=SimpleNamespace(mode="offline"), summary={}, finish=lambda exit_code: None)
    sink = WandbSink(Acc(), run)
    sink.log({"loss": 1.0}, 1)
    with pytest.raises(RuntimeError, match="wandb broke"):
        sink.close()
