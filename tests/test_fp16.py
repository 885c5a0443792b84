"""fp16 with dynamic loss scaling through DeepSpeed's real fp16 optimizers, on CPU.

DeepSpeed gives fp16 runs a different optimizer per stage (FP16_UnfusedOptimizer at ZeRO-0 with
a torch optimizer, DeepSpeedZeroOptimizer at ZeRO-1/2), and they keep the loss scale in
different places; zerotrain used to read `.cur_scale` / `.loss_scaler`, which the ZeRO-0 one
lacks, and crashed at the first log line. FSDP2's fp16 (its own loss scale on the global
gradient norm, train/strategy/loss_scale.py DynamicScale) runs the same checks through the trainer. tests/fp16_on_cpu.py lifts the CPU's fp16 refusals
so these run here: a NaN at step 2 is an overflow, the step is skipped and the scale halved;
three good steps later it doubles again (loss_scale_window 3); and a run resumed from the step-4
checkpoint continues with the same scale and the same losses as the uninterrupted one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO, ds_variant, metrics, subprocess_env

FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 1,
        "min_loss_scale": 1}
# FSDP2's loss scale takes DDP's GradScaler keys: no min_loss_scale (refused there)
FP16_OF = {"fsdp2_fp16": {k: v for k, v in FP16.items() if k != "min_loss_scale"}}
# The step whose logged scale is doubled again: GradScaler's rule (DDP, FSDP2) doubles at the
# 3rd clean step after the overflow (5); DeepSpeed's scaler logs it one step later.
GROWN_AT = {"fsdp2_fp16": 5}
ARGS = ["--model.name", "gpt-tiny", "--data.max_bytes", "100000", "--train.max_steps", "8",
        "--logging.every_steps", "1", "--train.eval_every", "0", "--checkpoint.every_steps", "4",
        "--logging.progress", "false", "--checkpoint.export", "false", "--train.sample_tokens", "0"]


def _run(args, env=None):
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "fp16_on_cpu.py"), *ARGS, *args], cwd=REPO,
                          env=subprocess_env(env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rows(run):
    return {r["step"]: r for r in metrics(run) if "loss" in r and "final/loss" not in r}


@pytest.mark.multiproc
@pytest.mark.parametrize("base", ["zero0", "zero2_fp16", "fsdp2_fp16"])
def test_fp16_loss_scale_skips_an_overflow_and_resumes_exactly(base, tmp_path):
    ds = ds_variant(tmp_path, base, f"{base}_test", bf16={"enabled": False}, fp16=FP16_OF.get(base, FP16),
                    data_types=None)
    full = tmp_path / "full"
    _run(["--ds-config", ds, "--train.run_dir", str(full)], env={"ZEROTRAIN_INJECT_NAN": "2"})
    rows = _rows(full)
    assert sorted(rows) == list(range(1, 9))
    scale = {s: r["loss_scale"] for s, r in rows.items()}
    assert scale[1] == 2.0 ** 16 and scale[2] == 2.0 ** 15, scale          # the overflow halves it
    grown = GROWN_AT.get(base, 6)
    assert scale[grown - 1] == 2.0 ** 15 and scale[grown] == 2.0 ** 16, scale  # 3 clean steps double it
    assert rows[1]["skipped_steps"] == 0 and rows[2]["skipped_steps"] == rows[8]["skipped_steps"] == 1
    assert rows[8]["loss"] < rows[1]["loss"] and all(rows[s]["loss"] == rows[s]["loss"] for s in (3, 8))

    resumed = tmp_path / "resumed"
    _run(["--ds-config", ds, "--train.run_dir", str(resumed),
          "--resume", str(full / "checkpoints" / "step_00000004")])
    again = _rows(resumed)
    assert sorted(again) == [5, 6, 7, 8]
    for s in again:
        assert again[s]["loss_scale"] == rows[s]["loss_scale"], (s, again[s], rows[s])
        assert again[s]["loss"] == rows[s]["loss"], (s, again[s]["loss"], rows[s]["loss"])
    assert again[8]["skipped_steps"] == 1  # the engine's count travels with the checkpoint
