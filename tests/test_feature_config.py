"""The features' bad input: one line naming the key and the fix, exit 2, before the model is
built (train/main.py run in this process: nothing is launched, no run directory is written)."""

from __future__ import annotations

import pytest

from helpers import TINY, run_main


@pytest.mark.parametrize("args,says", [
    (["--train.ema.decay", "1.5"], "train.ema.decay must be a number in (0, 1)"),
    (["--train.ema.decay", "0"], "train.ema.decay must be a number in (0, 1)"),
    (["--checkpoint.export_weights", "ema"], "checkpoint.export_weights ema: the run keeps no EMA; set train.ema"),
    (["--checkpoint.export_weights", "best"], 'checkpoint.export_weights must be "live" or "ema"'),
    (["--train.early_stop.patience", "2", "--train.eval_batches", "0"],
     'train.early_stop.metric "val/loss" is never logged: evaluation is off (train.eval_batches 0)'),
    (["--train.early_stop.metric", "val_ema/loss"],
     'train.early_stop.metric "val_ema/loss" is never logged: it needs train.ema'),
    (["--train.early_stop.metric", "loss"], "early stopping watches an evaluation metric"),
    (["--train.early_stop.patience", "0"], "train.early_stop.patience must be a positive number"),
])
def test_bad_feature_keys_are_one_line_exit_2(capsys, tmp_path, args, says):
    run_dir = tmp_path / "run"
    code, err = run_main(capsys, [*TINY, "--train.run_dir", str(run_dir), *args])
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and says in lines[0], err
    assert not run_dir.exists()  # refused before anything was built or written
