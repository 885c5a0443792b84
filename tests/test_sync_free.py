"""Between two log lines a training step makes no host read of a device value.

Each `.item()` / `float(t)` / `.cpu()` on a GPU tensor stalls the CPU until every queued
kernel has run, so the next step cannot be queued ahead: the trainer used to do several per
step (the loss copied to the host in float64 every micro-batch, `float(grad_norm)`, the fp16
scale, the stop vote read on the device). tests/sync_probe.py records every such read made
from train/ or models/ while a step runs; the loss, gradient norm and loss scale are now read
once per logging interval, and the stop vote lives on a CPU tensor over gloo.
"""

from __future__ import annotations

import json

import pytest

from helpers import BIN, REPO, TINY, ds_variant, free_port, subprocess_env


@pytest.mark.multiproc
@pytest.mark.parametrize("base", ["ddp", "zero2"])  # the two engines' step paths (the launcher does not matter)
def test_steps_between_log_lines_read_nothing_from_the_device(base, tmp_path):
    import subprocess
    ds = ds_variant(tmp_path, base, f"{base}_fp32", bf16={"enabled": False}, data_types=None)
    probe, port = tmp_path / "probe", str(free_port())
    launch = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port, str(REPO / "tests" / "sync_probe.py")]
    args = [*TINY, "--ds-config", ds, "--train.max_steps", "12", "--logging.every_steps", "4",
            "--train.eval_every", "0", "--train.run_dir", str(tmp_path / "run")]
    proc = subprocess.run([*launch, *args], cwd=REPO, env=subprocess_env({"ZT_SYNC_PROBE_DIR": str(probe)}),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((probe / f"rank{rank}.json").read_text())
        assert got["log_steps"] == [4, 8, 12]
        assert got["reads"] == [], f"rank {rank}: host reads inside training steps (step, where, op): {got['reads']}"
        assert got["vote_devices"] == ["cpu", "group:default"]  # gloo here; NCCL runs get a gloo side group
