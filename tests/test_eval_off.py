"""Evaluation switched off (train.eval_batches 0) and runs without a validation split: no val/*
rows, a banner that says so, a clean end, and a resume that continues exactly."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TINY, metrics, run_train, train_losses, write_token_file

from zerotrain.train.config import TrainConfig
from zerotrain.train.config.data_section import TokensData
from zerotrain.train.data.tokens import build_tokens
from zerotrain.train.errors import ConfigError


def test_eval_batches_zero_is_accepted_and_negative_refused():
    assert TrainConfig(eval_batches=0).eval_batches == 0
    with pytest.raises(ConfigError, match=r"train.eval_batches must be >= 0 \(0 = no evaluation\)"):
        TrainConfig(eval_batches=-1)


def test_no_validation_split_is_named_as_such(tmp_path):
    """data.val_fraction 0 and no sibling .val.bin: the data line names no validation file
    (it used to say "val: pre.val.bin", a file that does not exist)."""
    path = write_token_file(tmp_path / "pre.bin", np.arange(5000) % 256)
    bundle = build_tokens(TokensData(path=str(path), val_fraction=0.0), 64)
    assert bundle.val is None
    assert "no validation" in bundle.describe and ".val.bin" not in bundle.describe, bundle.describe


@pytest.mark.multiproc
def test_eval_off_writes_no_val_rows_and_resumes_exactly(tmp_path):
    off = ["--train.eval_batches", "0", "--train.eval_every", "2", "--checkpoint.every_steps", "2",
           "--train.max_steps", "4"]
    first = tmp_path / "first"
    proc = run_train("python", 1, [*TINY, *off, "--train.run_dir", str(first)])
    assert ", no validation (train.eval_batches 0)" in proc.stdout, proc.stdout
    rows = metrics(first)
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert not [k for r in rows for k in r if k.startswith("val/")]
    summary = proc.stdout[proc.stdout.index("zerotrain done"):]
    assert "validation" not in summary
    # Resume from step 2 into a new run directory: steps 3 and 4 are those of the first run.
    second = tmp_path / "second"
    proc = run_train("python", 1, [*TINY, *off, "--train.run_dir", str(second),
                                   "--resume", str(first / "checkpoints" / "step_00000002")])
    assert "resumed      at step 2" in proc.stdout
    resumed = train_losses(second)
    assert resumed == {s: v for s, v in train_losses(first).items() if s > 2}
    assert not [k for r in metrics(second) for k in r if k.startswith("val/")]
