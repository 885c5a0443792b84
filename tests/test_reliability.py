"""Reliability catalogue (issue 8): every bad input and injected fault, and what it produced.

Bad input must give one readable line (file / key / what is wrong / how to fix), exit code 2,
no traceback, and lose nothing already saved. Faults must not hang and must not lose work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import (BAD_SFT_RECORDS, MAIN, REPO, TINY, assert_resumable_checkpoint, fp32, run_main,
                     source_tokens, subprocess_env, write_token_file)
from zerotrain.train.commands.check import main as check_main


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def ds(tmp_path, body: dict, name="ds.json"):
    return write(tmp_path, name, json.dumps(body))


def sft_args(tmp_path, bad_line: str) -> list[str]:
    path = write(tmp_path, "d.jsonl", json.dumps({"prompt": "fine", "response": "ok"}) + "\n" + bad_line + "\n")
    return ["--model.name", "gpt-tiny", "--data.kind", "sft", "--data.path", path, "--data.seq_len", "32"]


def mixture_args(tmp_path, sources: str, *more: str) -> list[str]:
    """data.sources over two token files a.bin (bytes) and b.bin (another tokenizer); `sources`
    is the flow-style list with {a} and {b} for their paths."""
    a = write_token_file(tmp_path / "a.bin", source_tokens(0, 8, 32))
    b = write_token_file(tmp_path / "b.bin", source_tokens(1, 8, 32), tokenizer="/tok/gpt2", vocab_size=50257)
    return ["--model.name", "gpt-tiny", "--data.kind", "tokens", "--data.seq_len", "32",
            "--data.sources", sources.format(a=a, b=b), *more]


BAD_CONFIGS = {
    # name: (argv builder, substring of the message)
    "malformed yaml": (lambda t: ["--config", write(t, "run.yaml", "train:\n  max_steps: 3\n   x: 1\n")],
                       "run.yaml:3:"),
    "malformed json": (lambda t: ["--config", write(t, "run.json", '{"train": {"max_steps": 3,}}')],
                       "run.json:1:"),
    "unknown key": (lambda t: ["--config", write(t, "run.yaml", "train:\n  max_step: 3\n")],
                    'unknown key "train.max_step" (did you mean "max_steps"?)'),
    "unknown flag": (lambda t: ["--optim.lrr", "1"], 'unknown option "--optim.lrr" (did you mean "lr"?)'),
    "wrong type": (lambda t: ["--train.micro_batch_size", "big"], "train.micro_batch_size must be an integer"),
    "zero size": (lambda t: ["--train.micro_batch_size", "0"], "train.micro_batch_size must be a positive"),
    "negative lr": (lambda t: ["--optim.lr", "-1"], "optim.lr must be > 0"),
    "micro-batch contradiction": (
        lambda t: ["--ds-config", ds(t, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}),
                   "--train.micro_batch_size", "4"],
        '"train_micro_batch_size_per_gpu": 2 contradicts the run config train.micro_batch_size = 4'),
    "accumulation contradiction": (
        lambda t: ["--ds-config", ds(t, {"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 1}})],
        '"gradient_accumulation_steps": 8 contradicts'),
    "global batch not divisible": (lambda t: ["--train.global_batch_size", "10", "--train.micro_batch_size", "4"],
                                   "train.global_batch_size=10 is not divisible"),
    "zero-3 key in stage-2 file": (
        lambda t: ["--ds-config", ds(t, {"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9}})],
        "zero_optimization.stage3_max_live_parameters only apply to ZeRO-3"),
    "offload with a non-offloadable optimizer": (
        lambda t: ["--ds-config", ds(t, {"optimizer": {"type": "SGD"},
                                         "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})],
        '"optimizer.type" \'SGD\' is not supported'),
    "fp16 on cpu": (lambda t: ["--ds-config", ds(t, {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})],
                    "fp16 needs a CUDA GPU"),
    "missing ds config": (lambda t: ["--ds-config", str(t / "nope.json")], "nope.json not found"),
    "run dir not writable": (lambda t: ["--train.run_dir", "/proc/zerotrain-run"], "is not writable"),
    "missing text data": (lambda t: ["--data.path", str(t / "no-such-dir")], "no-such-dir does not exist"),
    "sequence longer than the context": (lambda t: ["--model.name", "gpt-tiny", "--data.seq_len", "65"],
                                         "data.seq_len 65 exceeds the model's context length 64"),
    "unknown model": (lambda t: ["--model.name", "gpt-tiniest"], 'model.name "gpt-tiniest" is unknown'),
    # Weighted mixtures of token files (data.sources).
    "mixture: unknown key in a source": (lambda t: mixture_args(t, "[{{path: '{a}', weight: 1, wieght: 2}}]"),
                                         'unknown key "data.sources[0].wieght" (did you mean "weight"?)'),
    "mixture: zero weight": (lambda t: mixture_args(t, "[{{path: '{a}', weight: 0}}]"),
                             "must be a number > 0 (got 0.0)"),
    "mixture: with data.path": (lambda t: mixture_args(t, "[{{path: '{a}', weight: 1}}]", "--data.path", "x.bin"),
                                "data.sources and data.path are both set"),
    "mixture: not token data": (lambda t: mixture_args(t, "[{{path: '{a}', weight: 1}}]", "--data.kind", "text"),
                                "data.sources is not a key of data.kind text (its keys: kind, path, seq_len"),
    "mixture: two tokenizers": (lambda t: mixture_args(t, "[{{path: '{a}', weight: 1}}, {{path: '{b}', weight: 1}}]"),
                                "b.bin were tokenized differently"),
    "mixture: missing file": (lambda t: mixture_args(t, "[{{path: '{a}', weight: 1}}, {{path: nope.bin, weight: 1}}]"),
                              "data.sources[1] (nope): data.path nope.bin does not exist"),
    # Instruction data (data.kind sft): the bad record is line 2 of d.jsonl, after a good one.
    **{f"sft: {case}": ((lambda line: lambda t: sft_args(t, line))(line), needle)
       for case, (line, needle) in BAD_SFT_RECORDS.items()},
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_configuration_gives_one_clear_line_and_exit_2(case, tmp_path, capsys, clean_env):
    argv_of, needle = BAD_CONFIGS[case]
    argv = argv_of(tmp_path)
    if "--train.run_dir" not in argv:
        argv += ["--train.run_dir", str(tmp_path / "run")]
    # A small default corpus where the case reads it (data.max_bytes is refused for other kinds).
    code, err = run_main(capsys, argv + ([] if "--data.kind" in argv else ["--data.max_bytes", "20000"]))
    assert code == 2, err
    assert needle in err, err
    assert err.startswith("zerotrain: error: ") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_bad_input_from_a_real_process_has_no_traceback_unless_debug(tmp_path):
    base = [sys.executable, MAIN, "--optim.lrr", "1"]
    p = subprocess.run(base, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        'zerotrain: error: unknown option "--optim.lrr" (did you mean "lr"?); valid keys under optim: '
        'lr, min_lr, warmup_steps, schedule, weight_decay, betas, eps']
    p = subprocess.run(base + ["--debug"], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert p.returncode != 0 and "Traceback" in p.stderr
    p = subprocess.run([sys.executable, MAIN, "--optim.lr"], capture_output=True, text=True, env=subprocess_env(),
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == ["zerotrain: error: --optim.lr needs a value"]



def _one_line_exit_2(p, *needles):
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("zerotrain: error: "), p.stderr[-3000:]
    assert all(n in lines[0] for n in needles), lines[0]


def test_a_corrupt_image_read_by_a_dataloader_worker_is_one_line(tmp_path):
    """ImageFolder decodes in DataLoader workers by default (1 per rank here): the worker's
    DataError reaches the user as the line it gives in-process, not torch's wrapper and traceback."""
    from zerotrain.train.data.make_shapes import make_shapes
    root = make_shapes(tmp_path / "img", ["red", "blue"], per_class=4, val_per_class=1, size=16)
    broken = root / "train" / "blue" / "blue_00001.jpg"
    broken.write_bytes(b"not a jpeg at all")
    p = subprocess.run([sys.executable, MAIN, "--ds-config", fp32(tmp_path, "ddp"), "--model.name",
                        "resnet18", "--data.kind", "imagefolder", "--data.path", str(root), "--data.image_size", "16",
                        "--train.micro_batch_size", "8", "--train.max_steps", "2", "--train.eval_every", "0",
                        "--logging.progress", "false", "--train.run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert "DataLoader worker" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    _one_line_exit_2(p, f"unreadable image {broken}", "data.on_bad_sample skip")


@pytest.mark.multiproc
def test_a_corrupt_image_only_rank_1_reads_is_the_same_line_from_rank_1(tmp_path):
    """2 ranks under the deepspeed launcher (which passes the rank's exit code on), 1 DataLoader
    worker each; every image rank 1 reads this epoch is corrupt, none of rank 0's. The user sees
    rank 1's line as in-process (prefixed with its rank), and only that: exit 2, no traceback."""
    from helpers import run_train
    from zerotrain.train.config import TrainConfig
    from zerotrain.train.data.make_shapes import make_shapes
    from zerotrain.train.data.sampler import GlobalBatchSampler
    root = make_shapes(tmp_path / "img", ["red", "blue"], per_class=4, val_per_class=1, size=16)
    files = sorted((root / "train").rglob("*.jpg"))  # ImageFolder's index order: classes, then files, sorted
    order = GlobalBatchSampler(len(files), micro=1, world=2, accum=1, seed=TrainConfig().seed).order(0).tolist()
    rank1 = [files[i] for i in order[1::2]]  # Accelerate gives rank r element r of each global micro-batch
    for f in rank1:
        f.write_bytes(b"not a jpeg at all")
    p = run_train("deepspeed", 2, ["--ds-config", fp32(tmp_path, "ddp"), "--model.name", "resnet18",
                                   "--data.kind", "imagefolder", "--data.path", str(root), "--data.image_size", "16",
                                   "--data.num_workers", "1", "--train.micro_batch_size", "1", "--train.max_steps", "4",
                                   "--train.eval_every", "0", "--logging.progress", "false",
                                   "--train.run_dir", str(tmp_path / "run")], check=False, timeout=300)
    errors = [line for line in p.stderr.splitlines() if "zerotrain: error: " in line]
    assert p.returncode == 2 and "Traceback" not in p.stderr and "DataLoader worker" not in p.stderr, p.stderr[-3000:]
    # Rank 0, which then loses rank 1 in a collective, exits 2 too (the launcher's exit code) and adds nothing.
    assert len(errors) == 1 and errors[0].startswith("[rank 1] zerotrain: error: unreadable image "), p.stderr[-3000:]
    assert any(str(f) in errors[0] for f in rank1) and "data.on_bad_sample skip" in errors[0], errors[0]


def test_a_bad_stream_record_read_by_a_tokenizer_worker_is_one_line(tmp_path):
    """data.kind stream tokenizes in its own pool (data.num_workers 1): a record without the text
    field, deep in the file, is named by byte offset in one line from the worker."""
    path = tmp_path / "x.jsonl"
    path.write_text("\n".join([json.dumps({"text": f"document {i} " * 20}) for i in range(3000)]
                              + ['{"txt": 1}']) + "\n")
    p = subprocess.run([sys.executable, MAIN, "--ds-config", fp32(tmp_path, "ddp"), "--model.name", "gpt-tiny",
                        "--data.kind", "stream", "--data.path", str(path), "--data.seq_len", "32",
                        "--data.num_workers", "1", "--train.micro_batch_size", "8", "--train.max_steps", "400",
                        "--train.eval_every", "0", "--logging.progress", "false", "--checkpoint.save_at_end", "false",
                        "--train.run_dir", str(tmp_path / "run")],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    _one_line_exit_2(p, "x.jsonl: record at byte", "has no field 'text' (fields: txt)")

HOSTFILES = {
    "syntax error": ("node0 slots=2\nnode1 slot=2\n", "hostfile:2: cannot parse \"node1 slot=2\""),
    "zero slots": ("node0 slots=2\nnode1 slots=0\n", "host node1 has slots=0"),
    "duplicate host": ("node0 slots=2\nnode0 slots=2\n", "host node0 is listed twice"),
    "empty": ("# nothing\n\n", "no hosts"),
}


@pytest.mark.parametrize("case", sorted(HOSTFILES))
def test_bad_hostfile_is_caught_by_zerotrain_check(case, tmp_path, capsys):
    text, needle = HOSTFILES[case]
    with pytest.raises(SystemExit) as e:
        check_main(["--hostfile", write(tmp_path, "hostfile", text)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err, err


def test_zerotrain_check_names_an_unknown_model(tmp_path, capsys):
    """`check` resolves the model as training does: a typo fails before any cluster time is spent."""
    with pytest.raises(SystemExit) as e:
        check_main(["--config", write(tmp_path, "run.yaml", "model:\n  name: gpt-tiniest\n")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and 'model.name "gpt-tiniest" is unknown (did you mean "gpt-tiny"?)' in err, err


def test_accelerate_yaml_disagreeing_with_hostfile_is_caught(tmp_path, capsys):
    hf = write(tmp_path, "hostfile", "node0 slots=2\nnode1 slots=2\n")
    yaml_path = str(REPO / "ds_configs" / "accelerate" / "multinode_zero2.yaml")  # says 16 processes
    with pytest.raises(SystemExit) as e:
        check_main(["--hostfile", hf, "--accelerate-config", yaml_path])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "num_processes: 16 but the hostfile has 4 slots" in err
    good = write(tmp_path, "acc.yaml", open(yaml_path).read().replace("num_processes: 16", "num_processes: 4"))
    assert check_main(["--hostfile", hf, "--accelerate-config", good, "--config",
                       str(REPO / "examples" / "default.yaml")]) == 0
    out = capsys.readouterr().out
    assert "ZeRO-2 (bf16) at world size 4" in out


# ---------------------------------------------------------------------------- numerical faults

@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp2"])
def test_nan_steps_are_skipped_then_the_run_stops_with_the_last_good_state(strategy, tmp_path, fp32_configs):
    """Rank 0's loss is NaN at step 3, then at 5 and 6: step 3 is skipped on every rank (the
    weights stay as they were), training goes on; two in a row hit train.max_bad_steps=2, and
    the run stops with exit 3, a message, and a checkpoint of the last good weights."""
    from helpers import metrics, run_train
    run = tmp_path / "run"
    proc = run_train("torchrun", 2, [*TINY, "--ds-config", fp32_configs[strategy], "--train.max_steps", "10",
                                     "--train.eval_every", "0", "--train.max_bad_steps", "2",
                                     "--checkpoint.save_at_end", "true", "--train.run_dir", str(run)],
                     env={"ZEROTRAIN_INJECT_NAN": "3,5,6"}, check=False)
    assert proc.returncode != 0
    err = proc.stderr
    assert "zerotrain: error: training diverged at step 6: 2 consecutive non-finite steps" in err, err[-3000:]
    assert "step 3: non-finite gradient norm" in proc.stdout
    rows = {r["step"]: r for r in metrics(run) if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]
    assert rows[3]["skipped_steps"] == 1 and rows[6]["skipped_steps"] == 3
    assert rows[3]["grad_norm"] in ("nan", "inf") or rows[3]["grad_norm"] != rows[3]["grad_norm"]
    assert isinstance(rows[4]["loss"], float) and rows[4]["loss"] == rows[4]["loss"]  # finite again after a skip
    # The stop left a complete checkpoint; it resumes (exit 0) and finishes the run.
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    if strategy != "zero2":
        return  # resuming is the same code for every strategy (tests/test_checkpoint.py); one launch less
    done = run_train("torchrun", 2, [*TINY, "--ds-config", fp32_configs[strategy], "--train.max_steps", "8",
                                     "--train.eval_every", "0", "--train.run_dir", str(run), "--resume", "auto"])
    assert done.returncode == 0
    resumed = {r["step"]: r["loss"] for r in metrics(run) if "loss" in r and r["step"] > 6}
    assert sorted(resumed) == [7, 8] and all(v == v for v in resumed.values())


# ---------------------------------------------------------------------------- process faults

def _start(args, env=None):
    from helpers import launch_cmd
    return subprocess.Popen(launch_cmd("torchrun", 2, args), cwd=REPO, env=subprocess_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for_step(run, step, proc, timeout=300):
    _wait_for(run, proc, lambda rows: any(r.get("step", 0) >= step and "loss" in r for r in rows),
              f"step {step}", timeout)


def _wait_for(run, proc, done, what, timeout=300):
    """Poll the run's metrics until done(rows) holds; fail if the run ends first."""
    import time
    from helpers import metrics
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early:\n{proc.stdout.read()[-3000:]}")
        try:
            if done(metrics(run)):
                return
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} not reached in {timeout} s")


def _rank_pids(run):
    from helpers import rank_infos
    return [i["pid"] for i in rank_infos(run)]


@pytest.mark.multiproc
def test_sigterm_finishes_the_step_checkpoints_and_exits_0(tmp_path, fp32_configs):
    """A scheduler's preemption signal to the ranks: they agree on a step, save, exit 0, and the
    save is a complete checkpoint of exactly that step, `latest` for --resume auto.
    Before the signal, checkpoint.every_minutes (0.002 min = 0.12 s) saves on rank 0's clock:
    each of those checkpoints holds both ranks' files, so both ranks saved at that step."""
    import signal
    from helpers import metrics
    from zerotrain.train.checkpoint import files as io
    run = tmp_path / "run"
    args = [*TINY, "--ds-config", fp32_configs["zero2"], "--train.max_steps", "100000", "--train.eval_every", "0",
            "--logging.every_steps", "1", "--train.run_dir", str(run),
            "--checkpoint.every_minutes", "0.002", "--checkpoint.keep_last", "1000"]
    proc = _start(args)
    # The signal goes in once two timed saves are on record (a step count alone raced the clock:
    # fast steps left one timed save before the stop).
    _wait_for(run, proc, lambda rows: sum("checkpoint/save_s" in r for r in rows) >= 2, "two timed saves")
    for pid in _rank_pids(run):
        os.kill(pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out[-3000:]
    stopped = max(r["step"] for r in metrics(run) if "loss" in r)   # nothing ran past the save
    assert stopped >= 2 and "(stopped by signal: resume with --resume auto)" in out
    assert_resumable_checkpoint(run / "checkpoints", stopped)
    saved = sorted(r["step"] for r in metrics(run) if "checkpoint/save_s" in r)
    timed = [s for s in saved if s < stopped]
    assert len(timed) >= 2, saved
    for s in timed:
        files = io.read_manifest(run / "checkpoints" / io.step_dir_name(s))["files"]
        assert {n.split(".")[0].split("-")[0] for n in files if n.endswith(".safetensors")} == \
            {"rank00000", "rank00001"}, (s, sorted(files))


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_sigterm_to_the_launcher_reaches_the_ranks_which_save_and_stop(tmp_path, fp32_configs, launcher):
    """`kill <launcher pid>`, as a scheduler preempts the command it started. The single-node
    `deepspeed` runner forwards no signal (it has a handler only for pdsh launches) and dies; the
    ranks see it gone (train/launch/launcher_watch.py) and stop as on SIGTERM. torchrun's agent
    forwards it. Either way every rank ends, the stop step is a complete checkpoint, the summary
    says so. Exit codes (docs/checkpoints.md): the deepspeed runner -15 (killed by the signal),
    torchrun 1 (its agent reports the signal), the ranks 0."""
    import signal
    import threading
    import time
    from helpers import launch_cmd, metrics
    run = tmp_path / "run"
    args = [*TINY, "--ds-config", fp32_configs["zero2"], "--train.max_steps", "100000", "--train.eval_every", "0",
            "--checkpoint.keep_last", "2", "--train.run_dir", str(run)]
    proc = subprocess.Popen(launch_cmd(launcher, 2, args), cwd=REPO, env=subprocess_env(None),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        _wait_for(run, proc, lambda rows: sum("loss" in r for r in rows) >= 3, "three steps")
        ranks = _rank_pids(run)
        os.kill(proc.pid, signal.SIGTERM)   # the launcher only, not its process group
        code = proc.wait(timeout=120)
        deadline = time.monotonic() + 120

        def alive(pid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                return False
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in ranks), f"ranks still training after the launcher's SIGTERM ({launcher})"
        time.sleep(0.5)  # the reader thread drains the pipe
        out = "".join(lines)
        assert code == {"deepspeed": -signal.SIGTERM, "torchrun": 1}[launcher], (code, out[-3000:])
        stopped = max(r["step"] for r in metrics(run) if "loss" in r)
        assert "(stopped by signal: resume with --resume auto)" in out, out[-3000:]
        assert_resumable_checkpoint(run / "checkpoints", stopped)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the launch is left (the old behaviour: the ranks)
        except ProcessLookupError:
            pass


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failed_final_save_exits_non_zero_naming_the_last_good_checkpoint(tmp_path, fp32_configs, mode):
    """The run dir on a 2.4 MiB tmpfs: the step-3 checkpoint (1.4 MiB) fits, the final step-6 one
    (checkpoint.save_at_end) cannot. The run must not end as a success: the ranks exit 2 (torchrun
    reports 1), the summary and the error name the last good checkpoint and the 3 steps no
    checkpoint holds, the partial save is cleaned up, and step 3 is still complete and `latest`.
    Asynchronously the write fails in the background: its warning must not promise a next save."""
    from helpers import run_train
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2400k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        run = mnt / "run"
        proc = run_train("torchrun", 2, [*TINY, "--ds-config", fp32_configs["zero2"], "--train.max_steps", "6",
                                         "--train.eval_every", "0", "--checkpoint.every_steps", "3",
                                         "--checkpoint.keep_last", "2", "--checkpoint.save_at_end", "true",
                                         "--checkpoint.async", str(mode == "async").lower(),
                                         "--train.run_dir", str(run)], check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode != 0, out[-3000:]   # ranks exit 2; torchrun itself reports 1
        good = run / "checkpoints" / "step_00000003"
        lost = f"the last good checkpoint is {good} (step 3): 3 steps (4-6) are in no checkpoint"
        assert "disk full" in out and lost in proc.stderr, out[-3000:]             # the error line
        assert lost in proc.stdout and f"checkpoint   {good} (the last good one" in proc.stdout, proc.stdout[-3000:]
        assert "the next save tries again" not in out, out[-3000:]
        assert_resumable_checkpoint(run / "checkpoints", 3)   # intact, `latest`, no half-written save left
    finally:
        subprocess.run(["umount", str(mnt)])


# ---------------------------------------------------------------------------- unwritable checkpoint directory

@pytest.fixture
def read_only_checkpoints(tmp_path):
    """A run dir whose checkpoints/ is a read-only tmpfs mount (what a read-only volume or another
    owner's directory does; root writes through permission bits, not through a read-only mount)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    run = tmp_path / "run"
    ck = run / "checkpoints"
    ck.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ck)]).returncode != 0:
        pytest.skip("cannot mount tmpfs here")
    try:
        yield run
    finally:
        subprocess.run(["umount", str(ck)])


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unwritable_checkpoint_directory_is_one_line_and_exit_2_before_training(
        rank, read_only_checkpoints, tmp_path, capsys, clean_env, fresh_accelerate, monkeypatch):
    """checkpoint.async into a run dir whose checkpoints/ cannot be written: every rank (here rank
    0 of one process, and rank 1 of two, which stops before any collective) stops before the data
    and the model with one line naming the directory and the fix, exit 2; no step runs."""
    run = read_only_checkpoints
    if rank:
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("LOCAL_RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "29577")
    code, err = run_main(capsys, [*TINY, "--ds-config", fp32(tmp_path, "ddp"), "--train.max_steps", "6",
                                  "--train.eval_every", "0", "--checkpoint.async", "true",
                                  "--checkpoint.every_steps", "3", "--train.run_dir", str(run),
                                  "--distributed.timeout_s", "20"])  # rank 1 alone: a check that came too late waits
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(("[rank 1] " if rank else "") + "zerotrain: error: "), err
    ck = run / "checkpoints"
    assert (f"the checkpoint directory {ck} is not writable (Read-only file system); make it writable" in lines[0]
            and "--train.run_dir" in lines[0]), err
    assert not (run / "metrics.jsonl").exists() and not any(ck.iterdir())  # nothing trained, nothing saved


def test_a_save_refused_by_permissions_names_the_directory_and_the_fix(tmp_path):
    """A checkpoint directory made read-only during the run (after the start's check): the save's
    error names the directory and what to do, not only the OS error."""
    import errno

    from zerotrain.train.checkpoint.save import describe
    root = tmp_path / "checkpoints"
    err = OSError(errno.EROFS, "Read-only file system", str(root / ".tmp-step_00000003"))
    line = describe(err, root)
    assert line.startswith(f"the checkpoint directory {root} is not writable (Read-only file system); make it "
                           f"writable") and "--train.run_dir" in line, line
    # safetensors' own error for a refused write: "(os error 13)"
    assert "is not writable" in describe(Exception("Permission denied (os error 13)"), root)
    assert "is not writable" not in describe(OSError(errno.EIO, "I/O error"), root)


# ---------------------------------------------------------------------------- long run

@pytest.mark.soak
@pytest.mark.multiproc
def test_soak_kill_one_rank_then_resume_matches_an_uninterrupted_run(tmp_path, fp32_configs):
    """40 steps over two epochs (12 kB of text), evaluation and checkpoints every 15 steps, dropout
    on. Rank 1 dies by SIGKILL once step 20 is done (ZEROTRAIN_INJECT_KILL: at a known step, so
    no machine is too fast or too slow for the kill to land between the checkpoints): the other
    rank exits instead of hanging, `--resume auto` continues from step 15 - before the epoch
    boundary - and every loss after it, and the final validation loss, equal the uninterrupted
    run's exactly."""
    from helpers import metrics, run_train
    common = [*TINY, "--ds-config", fp32_configs["zero2"], "--data.max_bytes", "12000", "--train.max_steps", "40",
              "--train.eval_every", "15", "--checkpoint.every_steps", "15", "--checkpoint.keep_last", "2",
              "--logging.every_steps", "1", "--model.dropout", "0.1", "--distributed.timeout_s", "60"]
    ref = tmp_path / "ref"
    run_train("torchrun", 2, [*common, "--train.run_dir", str(ref)])
    run = tmp_path / "run"
    killed = run_train("torchrun", 2, [*common, "--train.run_dir", str(run)], env={"ZEROTRAIN_INJECT_KILL": "1:20"},
                       check=False, timeout=240)   # bounded: a hang would time out here
    assert killed.returncode != 0
    assert max(r["step"] for r in metrics(run) if "loss" in r) == 20  # rank 0 stopped at the dead peer
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000015"
    run_train("torchrun", 2, [*common, "--train.run_dir", str(run), "--resume", "auto"])

    def by_step(rows, key):
        return {r["step"]: r[key] for r in rows if key in r}
    ref_rows, run_rows = metrics(ref), metrics(run)
    ref_loss, run_loss = by_step(ref_rows, "loss"), by_step(run_rows, "loss")
    # Rows logged again after the resume (16..40) replace the killed attempt's.
    assert {s: run_loss[s] for s in range(16, 41)} == {s: ref_loss[s] for s in range(16, 41)}
    assert by_step(run_rows, "val/loss")[40] == by_step(ref_rows, "val/loss")[40]
    assert by_step(ref_rows, "epoch")[15] < 1 <= by_step(ref_rows, "epoch")[40]  # the epoch ends after the resume point
