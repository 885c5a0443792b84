"""checkpoint.async (issue 39): a save's write runs in the background; nothing is lost at any
kill point. Every test launches 2 real processes (torchrun, ZeRO-2 fp32) and injects the fault
at a known point of the background write (train/testhooks.py):

  - SIGKILL of rank 1 during the write: the half-written save is never committed, `--resume
    auto` continues from the previous complete checkpoint, and the losses after it equal an
    uninterrupted (synchronous) run's bit for bit; the asynchronous checkpoint's tensor and RNG
    files are byte-identical to the synchronous run's;
  - a disk that fills during the write: one warning line, training goes on, the previous
    checkpoint stays `latest`, and the next save (once there is space again) succeeds;
  - SIGTERM during the write: the loop waits for it (logged), saves the stop step, exits 0 with
    both checkpoints complete.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from helpers import TINY, assert_resumable_checkpoint, launch_cmd, metrics, rank_infos, run_train, subprocess_env

pytestmark = pytest.mark.multiproc

COMMON = [*TINY, "--data.max_bytes", "12000", "--train.eval_every", "0", "--model.dropout", "0.1",
          "--optim.schedule", "constant", "--distributed.timeout_s", "60"]
ASYNC = ["--checkpoint.async", "true"]


def _step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _losses(run: Path) -> list[dict[int, float]]:
    """{step: loss} per launch (a resumed launch appends, restarting at an earlier step)."""
    runs, last = [{}], 0
    for r in metrics(run):
        if "loss" in r:
            if r["step"] <= last:
                runs.append({})
            runs[-1][r["step"]] = r["loss"]
            last = r["step"]
    return runs


def test_sigkill_during_the_background_write_resumes_from_the_previous_checkpoint_bit_identically(
        tmp_path, fp32_configs):
    from zerotrain.train.checkpoint import files as io
    args = [*COMMON, "--ds-config", fp32_configs["zero2"], "--train.max_steps", "9", "--checkpoint.every_steps", "3",
            "--checkpoint.keep_last", "5"]
    ref = tmp_path / "ref"
    run_train("torchrun", 2, [*args, "--train.run_dir", str(ref)])          # synchronous, uninterrupted
    run = tmp_path / "run"
    killed = run_train("torchrun", 2, [*args, *ASYNC, "--train.run_dir", str(run)],
                       env={"ZEROTRAIN_INJECT_KILL_IN_SAVE": "1:6"}, check=False, timeout=300)
    assert killed.returncode != 0
    root = run / "checkpoints"
    # Rank 1 died after writing its first file of step 6's save in the background: that save
    # was never committed (its directory is still .tmp-), step 3 stays `latest`.
    assert (root / "latest").read_text().strip() == "step_00000003"
    assert (root / ".tmp-step_00000006").is_dir() and not _step_dir(run, 6).exists()
    assert_step3 = io.read_manifest(_step_dir(run, 3))["files"]
    ref3 = io.read_manifest(_step_dir(ref, 3))["files"]
    same = {n for n in ref3 if n != io.META}   # meta.json holds the resolved config (checkpoint.async)
    assert {n: assert_step3[n] for n in same} == {n: ref3[n] for n in same}  # same files, same bytes
    resumed = run_train("torchrun", 2, [*args, *ASYNC, "--train.run_dir", str(run), "--resume", "auto"])
    assert f"resumed from {_step_dir(run, 3)}" in resumed.stdout
    ref_loss, after = _losses(ref)[0], _losses(run)[-1]
    assert sorted(after) == list(range(4, 10))
    assert after == {s: ref_loss[s] for s in range(4, 10)}
    assert_resumable_checkpoint(root, 6)  # the resumed run's save (TINY: no save at the end)


def _reader(proc, lines: list[str]):
    for line in proc.stdout:
        lines.append(line)


def _wait(proc, what: str, cond, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _stop(run: Path, proc) -> int:
    for info in rank_infos(run):
        os.kill(info["pid"], signal.SIGTERM)
    proc.wait(timeout=180)
    return proc.returncode


def test_disk_full_during_the_background_write_warns_once_and_the_next_save_succeeds(tmp_path, fp32_configs):
    """The run dir on a 4000 KiB tmpfs holding a 1600 KiB filler: the step-3 checkpoint (1.4 MiB)
    fits, the step-6 one does not. Once the warning is out the filler goes, and a later save
    completes while the run goes on."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4000k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    proc = None
    try:
        filler = mnt / "filler"
        filler.write_bytes(b"\0" * (1600 << 10))
        run = mnt / "run"
        cmd = launch_cmd("torchrun", 2, [*COMMON, *ASYNC, "--ds-config", fp32_configs["zero2"],
                                         "--train.max_steps", "100000", "--checkpoint.every_steps", "3",
                                         "--checkpoint.keep_last", "1", "--train.run_dir", str(run)], None)
        proc = subprocess.Popen(cmd, env=subprocess_env(None), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        lines: list[str] = []
        threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
        warned = lambda: [ln for ln in lines if "WARNING: checkpoint" in ln]  # noqa: E731
        _wait(proc, "the disk-full warning", lambda: warned())
        failed = int(warned()[0].split("step_")[1][:8])
        assert failed >= 6 and "disk full" in warned()[0], warned()
        assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000003"
        filler.unlink()

        def saved_after():
            latest = run / "checkpoints" / "latest"
            return latest.is_file() and int(latest.read_text().strip()[5:]) > failed
        _wait(proc, "a save after the failed one", saved_after)
        assert _stop(run, proc) == 0, "".join(lines)[-3000:]
        out = "".join(lines)
        # One line per failed save, for both ranks (a save started before the filler went may fail too).
        failed_steps = [int(ln.split("step_")[1][:8]) for ln in warned()]
        assert len(failed_steps) == len(set(failed_steps)) and all("disk full" in ln for ln in warned()), out[-3000:]
        assert not any(_step_dir(run, s).exists() for s in failed_steps)
        stopped = max(r["step"] for r in metrics(run) if "loss" in r)
        assert stopped > failed                                          # training went on
        assert_resumable_checkpoint(run / "checkpoints", stopped)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        subprocess.run(["umount", str(mnt)])


def test_sigterm_during_the_background_write_waits_for_it_then_exits_0_with_the_checkpoint_complete(
        tmp_path, fp32_configs):
    """Each rank's writer sends SIGTERM to its own process after its first file of step 4's save,
    and holds the rest of the write until the loop waits for it."""
    from zerotrain.train.checkpoint import files as io
    run = tmp_path / "run"
    proc = run_train("torchrun", 2, [*COMMON, *ASYNC, "--ds-config", fp32_configs["zero2"],
                                     "--train.max_steps", "100000", "--checkpoint.every_steps", "2",
                                     "--checkpoint.keep_last", "10", "--train.run_dir", str(run)],
                     env={"ZEROTRAIN_INJECT_SIGTERM_IN_WRITE": "4"}, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checkpoint step_00000004: waited" in proc.stdout, proc.stdout[-3000:]
    assert "(stopped by signal: resume with --resume auto)" in proc.stdout
    stopped = max(r["step"] for r in metrics(run) if "loss" in r)
    assert stopped > 4
    m = io.read_manifest(_step_dir(run, 4))        # the save the signal interrupted: complete
    assert [io.check_file(_step_dir(run, 4), n, rec) for n, rec in m["files"].items()] == [None] * len(m["files"])
    assert {n.split("-")[0].split(".")[0] for n in m["files"] if n.endswith(".safetensors")} == \
        {"rank00000", "rank00001"}
    assert_resumable_checkpoint(run / "checkpoints", stopped)
