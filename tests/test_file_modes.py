"""Every file a run writes gets the process umask's mode, checkpoint and reference safetensors
included: safetensors writes its files 0600 (a private temporary file renamed into place), which
on a shared cluster kept another account from resuming, importing or exporting a run."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest
from helpers import fp32

from zerotrain.train.checkpoint import files as ckpt_files


@pytest.fixture
def umask_027():
    """umask 027 for the test (files 0640), then the process's own back."""
    forget = getattr(ckpt_files, "process_umask", None)  # read once per process, cached
    old = os.umask(0o027)
    forget and forget.cache_clear()
    yield 0o640
    os.umask(old)
    forget and forget.cache_clear()


def _modes(root) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


def test_checkpoint_and_export_files_take_the_process_umask(tmp_path, umask_027, clean_env, fresh_accelerate):
    from zerotrain.train.main import main
    run = tmp_path / "run"
    assert main(["--model.name", "gpt-tiny", "--data.max_bytes", "200000", "--model.seq_len", "32",
                 "--data.seq_len", "32", "--train.max_steps", "2", "--train.micro_batch_size", "2",
                 "--train.eval_every", "0", "--train.sample_tokens", "0", "--logging.progress", "false",
                 "--logging.trackers", "jsonl", "--train.run_dir", str(run), "--ds-config", fp32(tmp_path, "ddp")]) == 0
    modes = _modes(run)
    tensors = [p for p in modes if p.endswith(".safetensors")]
    assert any(p.startswith("checkpoints/") for p in tensors) and any(p.startswith("export/") for p in tensors), modes
    assert {p: oct(m) for p, m in modes.items() if m != umask_027} == {}


def test_reference_log_probs_file_takes_the_process_umask(tmp_path, umask_027):
    from zerotrain.train.data import reference
    out = tmp_path / "ref.safetensors"
    reference.write(out, np.arange(3), np.zeros(3, np.float32), np.ones(3, np.float32), {"format": "x"})
    assert stat.S_IMODE(out.stat().st_mode) == umask_027
