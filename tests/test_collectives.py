"""debug.collectives: ranks that part ways are named in seconds, one line per rank, and nothing
already saved is lost (docs/troubleshooting.md "Collective mismatch").

Each launch is 2 real torchrun processes of the tiny GPT under DDP, saving every 2 steps; a test
hook (train/testhooks.py ZEROTRAIN_INJECT_DESYNC) makes one rank part ways at step 3: one more
all-reduce, a stop vote of another shape, an evaluation, a save, or a data loader that never
returns. Without the check each of these waits for the collective timeout (distributed.timeout_s,
30 min by default) and dies with a stack trace naming nothing; with it every rank prints one line
naming the operation, the shapes, the step and the ranks, and the step-2 checkpoint stays
complete and `latest`."""

from __future__ import annotations

import io
import re
import sys

import pytest

from helpers import REPO, TINY, run_train, train_losses

CHECK = ["--ds-config", "ds_configs/ddp.json", "--train.max_steps", "6", "--train.eval_every", "0",
         "--checkpoint.every_steps", "2", "--debug.collectives", "true"]
LAUNCH_TIMEOUT_S = 240   # what a hang would hit; each launch below ends well before it


def _launch(tmp_path, desync: str | None):
    run = tmp_path / "run"
    env = {"ZEROTRAIN_INJECT_DESYNC": desync} if desync else None
    proc = run_train("torchrun", 2, [*TINY, *CHECK, "--train.run_dir", str(run)], env=env, check=desync is None,
                     timeout=LAUNCH_TIMEOUT_S)
    return run, proc


def _lines(stderr: str, rank: int) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith(f"[rank {rank}] zerotrain: error:")]


def _assert_step2_checkpoint_intact(run):
    """`latest` still names step 2's checkpoint, every file of it matches its manifest, and no
    later checkpoint was completed."""
    from zerotrain.train.checkpoint import files as io
    root = run / "checkpoints"
    assert (root / io.LATEST).read_text().strip() == io.step_dir_name(2)
    ckpt = root / io.step_dir_name(2)
    manifest = io.read_manifest(ckpt)
    assert manifest["step"] == 2
    assert [io.check_file(ckpt, n, rec) for n, rec in manifest["files"].items()] == [None] * len(manifest["files"])
    assert sorted(p.name for p in root.iterdir() if io.STEP_DIR.fullmatch(p.name)) == [io.step_dir_name(2)]


# (hook, rank 0's line, rank 1's line): what each rank names
MISMATCHES = {
    "extra_allreduce:0:3": (r"collective mismatch at step 3 \(training step\): rank 0 runs ALLREDUCE of shape \[3\] "
                            r"\(float\) where rank 1 runs ALLREDUCE of shape \[(\d+)\]",
                            r"collective mismatch at step 3 \(stop vote\): rank 1 runs ALLREDUCE of shape \[\d+\] "
                            r"\(float\) where rank 0 runs ALLREDUCE of shape \[3\]"),
    "vote_shape:1:3": (r"collective mismatch at step 3 \(stop vote\): rank 0 runs ALLREDUCE of shape \[(\d+)\] "
                       r"\(float\) where rank 1 runs ALLREDUCE of shape \[\d+\]",
                       r"collective mismatch at step 3 \(stop vote\): rank 1 runs ALLREDUCE of shape \[\d+\] "
                       r"\(float\) where rank 0 runs ALLREDUCE of shape \[\d+\]"),
    "eval:0:3": (r"collective mismatch at step 3 \(evaluation\): rank 0 runs ALLGATHER of shape \[\d+\] \(float\) "
                 r"where rank 1 runs ALLREDUCE",
                 r"collective mismatch at step 4 \(training step\): rank 1 runs ALLREDUCE of shape \[\d+\] \(float\) "
                 r"where rank 0 runs ALLGATHER"),
    "save:1:3": (r"collective mismatch at step 4 \(training step\): rank 0 runs ALLREDUCE of shape \[\d+\] \(float\) "
                 r"where rank 1 runs ALLREDUCE of shape \[1\] \(long\)",
                 r"collective mismatch at step 3 \(save\): rank 1 runs ALLREDUCE of shape \[1\] \(long\) "
                 r"where rank 0 runs ALLREDUCE"),
}


@pytest.mark.multiproc
@pytest.mark.parametrize("desync", list(MISMATCHES))
def test_ranks_at_different_collectives_are_one_line_per_rank_and_the_checkpoint_survives(desync, tmp_path):
    run, proc = _launch(tmp_path, desync)
    assert proc.returncode != 0
    err = proc.stderr
    for rank, pattern in enumerate(MISMATCHES[desync]):
        lines = _lines(err, rank)
        assert len(lines) == 1, (rank, err[-4000:])
        assert re.search(pattern, lines[0]), (rank, lines[0])
        assert "ranks 0 and 1 differ" in lines[0] and f"{run}/checkpoints/step_00000002, is intact" in lines[0]
    assert "Detected mismatch between collectives" not in err  # torch's multi-line message, translated
    _assert_step2_checkpoint_intact(run)


@pytest.mark.multiproc
def test_a_rank_stuck_in_its_data_loader_is_named_with_its_stack(tmp_path):
    run, proc = _launch(tmp_path, "stuck_loader:1:3")
    assert proc.returncode != 0
    err = proc.stderr
    [waiting] = _lines(err, 0)
    assert "rank 1 did not come to the collective at step 3 (training step) within 20 s" in waiting, waiting
    [stuck] = _lines(err, 1)
    assert "this rank is stuck outside any collective at step 3 (training step): rank 0 waited 20 s" in stuck
    stack = err[err.index(stuck):]
    assert "in _next_batch" in stack and "in train_step" in stack, stack[:3000]  # faulthandler's dump, rank 1
    _assert_step2_checkpoint_intact(run)


@pytest.mark.multiproc
def test_ranks_far_apart_at_start_up_train_and_a_rank_stuck_later_is_named_in_the_short_timeout(tmp_path):
    """Start-up keeps distributed.timeout_s: rank 1 comes to its first step 25 s after rank 0
    (a slow import or data prepare), 2.5 times debug.collectives_timeout_s, and both train; from
    the end of the first step on the short timeout applies: rank 1 stuck in its loader at step 3
    is named after 10 s, not distributed.timeout_s (30 min)."""
    run = tmp_path / "run"
    proc = run_train("torchrun", 2, [*TINY, *CHECK, "--debug.collectives_timeout_s", "10", "--train.run_dir", str(run)],
                     env={"ZEROTRAIN_INJECT_SLOW_START": "1:25", "ZEROTRAIN_INJECT_DESYNC": "stuck_loader:1:3"},
                     check=False, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0
    err = proc.stderr
    assert sorted(train_losses(run)) == [1, 2], err[-4000:]
    [waiting] = _lines(err, 0)
    assert "rank 1 did not come to the collective at step 3 (training step) within 10 s (debug.collectives_timeout_s)" \
        in waiting, waiting
    [stuck] = _lines(err, 1)
    assert "this rank is stuck outside any collective at step 3 (training step): rank 0 waited 10 s" in stuck
    _assert_step2_checkpoint_intact(run)


@pytest.mark.multiproc
def test_with_the_check_on_a_run_that_agrees_trains_to_the_end_with_the_same_numbers(tmp_path):
    """No false alarm, and nothing changed: the same launch without a fault trains its 6 steps
    with the very losses of a launch without the check (DDP's gradient all-reduces go through the
    wrapper too)."""
    run, proc = _launch(tmp_path, None)
    assert "zerotrain: error" not in proc.stderr
    plain = tmp_path / "plain"
    run_train("torchrun", 2, [*TINY, *CHECK, "--debug.collectives", "false", "--train.run_dir", str(plain)],
              timeout=LAUNCH_TIMEOUT_S)
    checked = train_losses(run)
    assert sorted(checked) == [1, 2, 3, 4, 5, 6]
    assert checked == train_losses(plain)


# ---------------------------------------------------------------------------- no launch

# torch 2.14's message from a ProcessGroupWrapper (TORCH_DISTRIBUTED_DEBUG=DETAIL, gloo), as rank 1 raised it
TORCH_MISMATCH = (
    "Detected mismatch between collectives on ranks. Rank 1 is running collective: CollectiveFingerPrint("
    "SequenceNumber=30, OpType=ALLREDUCE, TensorShape=[7], TensorDtypes=Float, TensorDeviceTypes=TensorOptions("
    "dtype=float (default), device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false "
    "(default), memory_format=(nullopt))), but Rank 0 is running collective: CollectiveFingerPrint(SequenceNumber=30, "
    "OpType=BROADCAST, TensorShape=[6], TensorDtypes=Long, TensorDeviceTypes=TensorOptions(dtype=float (default), "
    "device=cpu, layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))).Collectives differ in the following aspects: \t Op type: ALLREDUCEvs BROADCAST  "
    "Tensor Tensor shapes: 7vs 6  Tensor Tensor dtypes: Floatvs Long")


def test_torchs_mismatch_message_becomes_one_line(monkeypatch, tmp_path):
    from zerotrain.train import process_group
    from zerotrain.train.launch import collectives
    monkeypatch.setitem(collectives._STATE, "on", True)
    monkeypatch.setitem(collectives._STATE, "run_dir", tmp_path)
    monkeypatch.setenv("RANK", "1")
    process_group.at("save", 12)
    try:
        line = collectives.explain(RuntimeError(TORCH_MISMATCH))
    finally:
        process_group.at("start-up", None)
    assert line == ("[rank 1] zerotrain: error: collective mismatch at step 12 (save): rank 1 runs ALLREDUCE of shape "
                    "[7] (float) where rank 0 runs BROADCAST of shape [6] (long) (collective #30); ranks 0 and 1 "
                    "differ. Every rank must run the same collectives in the same order: look for work done on some "
                    "ranks only (a save, an evaluation or a reduction under `if rank == ...`) or a tensor whose shape "
                    "depends on the rank (docs/troubleshooting.md \"Collective mismatch\"). No checkpoint had been "
                    "saved yet.")
    monkeypatch.setitem(collectives._STATE, "on", False)  # the check off: nothing is translated
    assert collectives.explain(RuntimeError(TORCH_MISMATCH)) is None


def test_each_rank_line_reaches_the_shared_stderr_in_one_write(monkeypatch, tmp_path):
    """The ranks share the launcher's stderr. A line written in two writes (print(): the text,
    then its newline, under PYTHONUNBUFFERED as tests/helpers.py launches) let another rank's
    line land between them, glued to the end of this one: about 1 launch in 3 of the extra
    all-reduce above then showed a rank "without its line". Each line must be one write."""
    from zerotrain.train import process_group
    from zerotrain.train.errors import ConfigError, user_errors
    from zerotrain.train.launch import collectives

    class Raw(io.FileIO):  # a real file; remembers each write the stream makes
        writes: list

        def write(self, b):
            self.writes.append(bytes(b))
            return super().write(b)

    raw = Raw(tmp_path / "stderr", "w")
    raw.writes = []
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))  # python -u
    monkeypatch.setitem(collectives._STATE, "on", True)
    monkeypatch.setitem(collectives._STATE, "run_dir", tmp_path)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    process_group.at("save", 12)
    try:
        assert collectives.report(RuntimeError(TORCH_MISMATCH))
    finally:
        process_group.at("start-up", None)
    with pytest.raises(SystemExit), user_errors():
        raise ConfigError("data.path x does not exist")
    lines = [w.decode() for w in raw.writes]
    assert [line.startswith("[rank 1] zerotrain: error: ") and line.endswith("\n") and line.count("\n") == 1
            for line in lines] == [True, True], lines
    assert lines[1] == "[rank 1] zerotrain: error: data.path x does not exist\n"


def test_the_check_is_a_config_key_with_a_positive_timeout():
    from zerotrain.train.config import load_config
    from zerotrain.train.errors import ConfigError
    cfg = load_config(None, [("debug.collectives", "true")])
    assert cfg.debug.collectives is True and cfg.debug.collectives_timeout_s == 20
    with pytest.raises(ConfigError, match="debug.collectives_timeout_s"):
        load_config(None, [("debug.collectives_timeout_s", "0")])


def test_a_missing_rank_is_named_by_rank_0_and_by_the_others(monkeypatch, tmp_path):
    """torch 2.14's messages when a rank does not come (world 2): rank 0 names the rank missing;
    rank 1, when rank 0 is the one missing, hears only that rank 0 did not answer."""
    from zerotrain.train import process_group
    from zerotrain.train.launch import collectives
    monkeypatch.setitem(collectives._STATE, "on", True)
    monkeypatch.setitem(collectives._STATE, "timeout_s", 20)
    monkeypatch.setitem(collectives._STATE, "timeout_key", "debug.collectives_timeout_s")
    monkeypatch.setitem(collectives._STATE, "run_dir", tmp_path)
    monkeypatch.setattr(collectives, "_ask_for_stacks", lambda ranks, waited: asked.append((ranks, waited)))
    monkeypatch.setattr(process_group, "size", lambda: 2)
    asked = []
    monkeypatch.setenv("RANK", "0")
    line = collectives.explain(RuntimeError("[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 20000 ms"))
    assert line.startswith("[rank 0] zerotrain: error: rank 1 did not come to the collective at start-up within 20 s "
                           "(debug.collectives_timeout_s)")
    monkeypatch.setenv("RANK", "1")
    line = collectives.explain(RuntimeError(
        "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0. "
        "Please check rank 0 logs for faulty rank.\n Original exception: \n[gloo/transport/tcp/unbound_buffer.cc:129] "
        "Timed out waiting 20000ms for send operation to complete"))
    assert line.startswith("[rank 1] zerotrain: error: rank 0 did not come to the collective at start-up within 20 s")
    assert asked == [([1], 20.0), ([0], 20)]


USER_MODEL = ["--model.name", "py:user_models.extra_collective:build"]  # tests/user_models/extra_collective.py


@pytest.mark.multiproc
@pytest.mark.parametrize("ds", ["ddp", "zero2", "zero3"])
def test_a_users_rank_zero_only_all_reduce_is_named_under_every_backend(ds, tmp_path, fp32_configs):
    """A py: model all-reduces a [5, 7] tensor on rank 0 only, inside its forward at step 3. Under
    DDP and ZeRO-3 rank 1 is then at the engine's next collective on the same group (DDP's gradient
    all-reduce, ZeRO-3's parameter all-gather): torch's check meets the mismatch at once, but
    decodes rank 0's side from a gather that itself mismatched, so each rank asks the other what it
    runs. Under ZeRO-2 rank 1 is in DeepSpeed's gradient all-reduce on DeepSpeed's own process
    group, which never meets rank 0's default-group collective: after debug.collectives_timeout_s
    (20 s) rank 0 asks rank 1, which answers from its own record that it is in a collective (not
    "stuck outside any collective"), and both name the two. Either way each rank prints one line
    with the operation, the shapes, the step and both ranks, the user's call site included."""
    run = tmp_path / "run"
    proc = run_train("torchrun", 2, [*TINY, *USER_MODEL, *CHECK[2:], "--ds-config", fp32_configs[ds],
                                     "--train.run_dir", str(run)],
                     env={"PYTHONPATH": str(REPO / "tests")}, check=False, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode != 0
    err = proc.stderr
    lines = {rank: _lines(err, rank) for rank in (0, 1)}
    assert all(len(v) == 1 for v in lines.values()), err[-4000:]
    user = "all_reduce of [5, 7] (float32) on the default group, called from tests/user_models/extra_collective.py:23 forward" \
        if ds == "zero2" else "ALLREDUCE of shape [5, 7] (float)"
    assert re.search(r"collective mismatch at step 3 \(training step\): rank 0 runs " + re.escape(user), lines[0][0]), lines
    assert re.search(r"collective mismatch at step 3 \(training step\): rank 1 runs .* where rank 0 runs "
                     + re.escape(user), lines[1][0]), lines
    assert "extra_collective.py:23 forward" in lines[1][0]  # the user's line, in the other rank's line too
    if ds == "zero2":  # DeepSpeed's reduction, on its own group, named as such
        assert ("rank 1 runs all_reduce of [" in lines[0][0] and "on a group of ranks [0, 1] other than the default one"
                in lines[0][0] and "allreduce_bucket" in lines[0][0]), lines[0]
        assert "found after 20 s, debug.collectives_timeout_s" in lines[0][0]
    assert "stuck outside any collective" not in err
    _assert_step2_checkpoint_intact(run)
