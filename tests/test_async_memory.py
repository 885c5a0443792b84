"""checkpoint.async is memory-honest (issue 39, item 4): the memory plan counts each rank's host
snapshot, and where the plan with it would not leave distributed.memory_margin of the budget free,
the run saves synchronously and says so in one banner line.

In-process: the plan's numbers on budgets the test sets (train/plan/memory_plan.py make(), the
path a run takes). Launched (2 ranks, torchrun): an uncapped run's plan against the snapshot its
Checkpointer really kept, then the same run under a per-rank memory cgroup (bench/memcap.py, as
tests/test_fit.py caps) halfway between its plan without the snapshot and with it: it falls back
to synchronous saves, trains and saves."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import BIN, MAIN, REPO, assert_resumable_checkpoint, free_port, metrics, subprocess_env

sys.path.insert(0, str(REPO / "bench"))
import memcap  # noqa: E402

GiB = 2 ** 30
# 10.6M parameters: each rank's snapshot (12 bytes x its half) is ~56 MiB, well above the few MiB
# a rank's runtime varies by between launches.
MODEL = ["--model.name", "gpt-small-cpu", "--model.d_model", "384", "--model.n_layer", "6",
         "--data.seq_len", "64", "--data.max_bytes", "300000", "--train.micro_batch_size", "1"]
RUN = [*MODEL, "--train.max_steps", "5", "--train.eval_every", "0", "--train.eval_batches", "1",
       "--logging.progress", "false", "--train.sample_tokens", "0", "--logging.every_steps", "1",
       "--optim.warmup_steps", "1", "--checkpoint.every_steps", "2", "--checkpoint.save_at_end", "false",
       "--checkpoint.export", "false", "--checkpoint.async", "true",
       # a synchronous save's host copy is one file: keep it small under the cap
       "--checkpoint.max_shard_size", "16MB"]


def _inputs(zero2_json: str, async_: bool = True, check: bool = True):
    from zerotrain.models import resolve as resolve_model
    from zerotrain.train.config import load_config
    from zerotrain.train.data import build_data
    from zerotrain.train.strategy.ds_config import load_ds_setup
    args = [*MODEL, "--checkpoint.async", str(async_).lower(), "--distributed.memory_check", str(check).lower()]
    cfg = load_config(None, [(k[2:], v) for k, v in zip(args[::2], args[1::2])])
    batch = cfg.train.batch(2)
    return cfg, resolve_model(cfg.model), load_ds_setup(zero2_json, cfg, batch, 3, cuda=False, hidden_size=384), \
        build_data(cfg.data, 64, cfg.train.seed), batch


def _plan(inputs, nbytes: float, runtime: int = GiB):
    from zerotrain.train.plan.memory_plan import make
    cfg, spec, ds, data, batch = inputs
    view = {"bytes": int(nbytes), "source": "a test budget", "cgroup": None, "host": "h", "runtime": runtime}
    return make(cfg, spec, ds, data, batch, 64, 2, 0, "cpu", True, view=view)


def test_the_plan_counts_the_snapshot_and_falls_back_to_synchronous_saves_where_it_would_not_fit(
        fp32_configs, capsys):
    from zerotrain.train.plan import memory_check
    from zerotrain.train.plan.estimate import CUDA, estimate, snapshot_bytes
    from zerotrain.train.strategy.option import Option
    on, off = _inputs(fp32_configs["zero2"]), _inputs(fp32_configs["zero2"], async_=False)
    shape = memory_check.model_shape(on[1], on[3])
    snap = snapshot_bytes(shape, 2)
    # fp32 master + two moments of each rank's (larger) half of every trained tensor
    assert snap == 12 * sum(math.ceil(t / 2) for t in shape.tensors) and 50 * 2**20 < snap < 60 * 2**20
    # Room enough: the snapshot is in both estimates, on top of the synchronous plan to the byte.
    a, s = _plan(on, 64 * GiB), _plan(off, 64 * GiB)
    assert not a.async_off
    assert a.estimate.snapshot == a.checked.snapshot == snap and s.checked.snapshot == 0
    assert a.checked.device_total == s.checked.device_total + snap
    assert a.estimate.device_total == s.estimate.device_total + snap
    assert "checkpoint.async snapshot" in a.text and a.checked.to_dict()["checkpoint_snapshot_bytes"] == snap
    # On CUDA the snapshot is host RAM: reported, not part of the device's peak.
    gpu = estimate(shape, Option.from_setup(on[2]), 2, memory_check.plan_batch(on[0], on[4], 64), device=CUDA,
                   snapshot=snap)
    assert gpu.snapshot == snap and gpu.device_total == estimate(
        shape, Option.from_setup(on[2]), 2, memory_check.plan_batch(on[0], on[4], 64), device=CUDA).device_total
    # A budget whose margin the synchronous plan leaves free, the asynchronous one not: synchronous saves.
    margin = on[0].distributed.memory_margin
    between = (s.checked.device_total + snap / 2) / (1 - margin)
    f = _plan(on, between)
    assert f.async_off.startswith("checkpoint.async off: its host snapshot (") and "saves are synchronous" in f.async_off
    assert "a test budget" in f.async_off and "\n" not in f.async_off
    assert f.checked.snapshot == f.estimate.snapshot == 0 and f.checked.device_total == s.checked.device_total
    # Without the memory check nothing is compared: the snapshot is planned, saves stay asynchronous.
    unchecked = _plan(_inputs(fp32_configs["zero2"], check=False), between)
    assert not unchecked.async_off and unchecked.estimate.snapshot == snap and unchecked.checked is None
    # A budget the synchronous plan does not fit either: refused as before, with or without async.
    with pytest.raises(memory_check.DoesNotFit):
        _plan(on, s.checked.device_total * 0.8)
    capsys.readouterr()


def _launch(args: list[str], cap: int | None = None) -> subprocess.CompletedProcess:
    wrap = [str(REPO / "bench" / "memcap.py"), "--limit", f"{cap}B", "--"] if cap else []
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), *wrap, MAIN, *args]
    return subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)


@pytest.mark.multiproc
def test_a_snapshot_that_would_not_fit_under_the_cap_saves_synchronously_with_one_banner_line(tmp_path, fp32_configs):
    why = memcap.can_cap()
    if why is not None:
        pytest.skip(f"cannot create a memory cgroup here ({why})")
    from zerotrain.train.plan.estimate import snapshot_bytes
    from zerotrain.train.plan import memory_check
    args = [*RUN, "--ds-config", fp32_configs["zero2"]]
    # 1. Uncapped: asynchronous saves; the plan's snapshot is the one the Checkpointer kept.
    free = tmp_path / "free"
    p = _launch([*args, "--train.run_dir", str(free)])
    assert p.returncode == 0, p.stderr[-4000:]
    resolved = json.loads((free / "config.json").read_text())["resolved"]
    inputs = _inputs(fp32_configs["zero2"])
    snap = snapshot_bytes(memory_check.model_shape(inputs[1], inputs[3]), 2)
    assert resolved["memory_plan"]["checkpoint_snapshot_bytes"] == snap
    saves = [r for r in metrics(free) if "checkpoint/save_s" in r]
    assert len(saves) == 2 and all("checkpoint/write_s" in r for r in saves)
    kept = saves[-1]["checkpoint/snapshot_bytes"]  # rank 0's: its part of each ZeRO-2 partition
    assert abs(kept - snap) <= 12 * 64, (kept, snap)
    assert "checkpoint.async off" not in p.stdout
    # 2. Capped halfway between the plan without the snapshot and with it (plus the margin).
    plan = _plan(inputs, 64 * GiB, runtime=resolved["memory_budget"]["runtime_bytes"])
    margin = inputs[0].distributed.memory_margin
    cap = int((plan.checked.device_total - snap / 2) / (1 - margin))
    run = tmp_path / "capped"
    p = _launch([*args, "--train.run_dir", str(run)], cap=cap)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    lines = [line for line in p.stdout.splitlines() if "checkpoint.async off" in line]
    assert len(lines) == 1 and lines[0].startswith("  checkpoint   checkpoint.async off: its host snapshot ("), p.stdout
    assert "memory cgroup limit" in lines[0]
    resolved = json.loads((run / "config.json").read_text())["resolved"]
    assert resolved["checkpoint_async_off"] == lines[0].strip()[len("checkpoint   "):]
    assert resolved["memory_plan"]["checkpoint_snapshot_bytes"] == 0
    saves = [r for r in metrics(run) if "checkpoint/save_s" in r]
    assert len(saves) == 2 and not any("checkpoint/write_s" in r for r in saves)  # synchronous saves
    assert_resumable_checkpoint(run / "checkpoints", 4)


def test_on_a_gpu_the_pinned_snapshot_is_checked_against_the_free_host_ram(fp32_configs, monkeypatch):
    """On CUDA the snapshot is pinned host RAM, outside the GPU's budget: the plan compares it with
    the tightest rank's free host RAM (memory_check.local_view's host_free, agreed like the
    budget) less the margin, and saves synchronously with one banner line where it does not fit."""
    from zerotrain.train.plan import memory_check
    from zerotrain.train.plan.estimate import snapshot_bytes
    from zerotrain.train.plan.memory_plan import make
    monkeypatch.setattr(memory_check.torch.cuda, "is_available", lambda: True)  # the budget is a GPU's
    cfg, spec, ds, data, batch = _inputs(fp32_configs["zero2"])
    snap = snapshot_bytes(memory_check.model_shape(spec, data), 2)

    def plan(host_free: float):
        view = {"bytes": 80 * GiB, "source": "a test GPU", "cgroup": None, "host": "h", "runtime": 0,
                "host_free": int(host_free), "host_source": "a test host"}
        return make(cfg, spec, ds, data, batch, 64, 2, 0, "cuda", True, view=view)

    roomy, tight = plan(2 * snap), plan(1.05 * snap)  # 1.05 x snap less the 10% margin < snap
    assert roomy.budget.device == "cuda" and not roomy.async_off and roomy.estimate.snapshot == snap
    assert tight.estimate.snapshot == 0 and tight.async_off.startswith(
        "checkpoint.async off: its pinned host snapshot (") and "a test host" in tight.async_off
    assert "less the 10% margin; saves are synchronous" in tight.async_off
    # The GPU's own peak is the same either way: the snapshot never counted there.
    assert roomy.checked.device_total == tight.checked.device_total
