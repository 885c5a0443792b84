"""Training observability without W&B: throughput / MFU arithmetic, the metrics in
metrics.jsonl, console banner / progress / summary, and `zerotrain plot`."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import metrics
from wandb_offline import PEAK_FLOPS, observed_run

from zerotrain.models.gpt import preset
from zerotrain.train.observe import perf, report
from zerotrain.train.cli import main as zerotrain

# gpt-tiny by hand (models/gpt.py: V=256, T=64, L=2, D=64, 4 heads of 16, 2 KV heads, tied):
#   attention  D*(D + 2*KV*16) + D*D = 64*128 + 4096          = 12288
#   SwiGLU     ffn = ceil64(8*64//3 = 170) = 192; 3*D*ffn      = 36864
#   per layer  12288 + 36864 + 2*64 (norms)                    = 49280
#   non-emb    2*49280 + 64 (final norm)                       = 98624
#   N          98624 + V*D (lm_head matmul, tied)              = 115008
#   FLOPs/tok  6*N + 12*L*D*T = 690048 + 98304                 = 788352
GPT_TINY_FLOPS_PER_TOKEN = 788_352
SEQ = 64
GLOBAL_BATCH = 8  # TINY: micro 4 x accum 1 x 2 ranks


def test_gpt_tiny_flops_per_token_matches_hand_count():
    assert preset("gpt-tiny").flops_per_token(SEQ) == GPT_TINY_FLOPS_PER_TOKEN


def test_throughput_and_mfu_arithmetic():
    # 10 steps of 8 x 64-token samples in 4 s on 2 devices of 1 TFLOP/s peak each.
    got = perf.throughput(samples=80, seconds=4.0, items_per_sample=SEQ, flops_per_item=GPT_TINY_FLOPS_PER_TOKEN,
                          world_size=2, peak_per_device=1e12)
    assert got["samples_per_s"] == 20.0
    assert got["tokens_per_s"] == 1280.0
    # 1280 tok/s * 788352 FLOP/tok = 1.00909056e9 FLOP/s over 2e12 peak
    assert got["mfu"] == pytest.approx(1.00909056e9 / 2e12, rel=1e-12)
    # No peak (CPU, unknown GPU, no --peak-flops): no MFU rather than a made-up one.
    assert "mfu" not in perf.throughput(samples=80, seconds=4.0, items_per_sample=SEQ, flops_per_item=1.0,
                                        world_size=2, peak_per_device=None)
    # Not an LM: samples only.
    assert set(perf.throughput(samples=8, seconds=2.0, items_per_sample=1, flops_per_item=None, world_size=1,
                               peak_per_device=1e12)) == {"samples_per_s"}


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
    ("NVIDIA GH200 480GB", 989e12), ("NVIDIA A10G", None), ("Tesla T4", None),
])
def test_peak_flops_lookup_prefers_the_most_specific_name(name, peak):
    assert perf.lookup_peak_flops(name) == peak


# ---------------------------------------------------------------------------- the real 2-process run

@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    return observed_run(tmp_path_factory)


@pytest.mark.multiproc
def test_logged_rates_follow_from_step_time_and_model_flops(observed):
    run_dir = observed[0]
    rows = [r for r in metrics(run_dir) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert r["samples_per_s"] == pytest.approx(GLOBAL_BATCH / r["step_time_s"], rel=1e-9)
        assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * SEQ, rel=1e-9)
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * GPT_TINY_FLOPS_PER_TOKEN / (2 * PEAK_FLOPS), rel=1e-9)
        assert r["data_wait_s"] + r["compute_s"] == pytest.approx(r["step_time_s"], rel=1e-9)
        assert r["tokens_seen"] == r["step"] * GLOBAL_BATCH * SEQ
        assert r["peak_mem_bytes"] > 10 * 2**20  # RSS of a torch process on CPU
        assert r["grad_norm"] > 0 and r["skipped_steps"] == 0
    val = [r for r in metrics(run_dir) if "val/loss" in r]
    assert [r["step"] for r in val] == [3, 6]  # eval_every 3, plus the end


@pytest.mark.multiproc
def test_console_banner_progress_and_summary(observed):
    run_dir, proc = observed[0], observed[1]
    out = proc.stdout
    # A compact start: the banner's lines and no dump of the resolved config (it is in config.json).
    start = out.index("zerotrain ---")
    lines = out[start:].splitlines()
    banner = "\n".join(lines[:1 + next(i for i, x in enumerate(lines[1:]) if not x.startswith("  "))])
    assert "2 process(es) on 1 node(s), launcher torchrun, cpu / gloo" in banner
    assert "ZeRO-2 (fp32)" in banner
    assert "global 8 samples = 512 tokens/step" in banner
    assert "115.01k params" in banner
    assert "per rank (estimated)" in banner and "\n  memory       estimated peak " in banner
    memory = next(line for line in banner.splitlines() if line.startswith("  memory "))
    assert "counts the memory a rank owns, not the " in memory and " of shared library code that top's RES adds" in memory
    assert f"\n  run dir      {run_dir}\n  full config: {run_dir / 'config.json'}\n" in banner
    assert json.loads((run_dir / "config.json").read_text())["resolved"]["world_size"] == 2
    assert "\n  W&B offline run in " in banner and len(banner.splitlines()) <= 14, banner
    assert '"deepspeed_config"' not in out[:start] and "resolved config" not in out
    # logging.progress false: one plain progress line per logging interval, on rank 0 only.
    progress = [line for line in out.splitlines() if line.startswith("step ") and "/6  loss" in line]
    assert len(progress) == 6 and progress[-1].startswith("step 6/6") and "eta 0.0s" in progress[-1]
    last = [r for r in metrics(run_dir) if "loss" in r][-1]
    summary = out[out.index("zerotrain done"):]
    assert "6 steps in" in summary and "3.07k tokens" in summary  # 6 x 512
    assert f"final train loss {last['loss']:.4f}" in summary
    # the measured peak (the worst rank's, over the run) beside the estimate
    peak = max(r["peak_mem_bytes"] for r in metrics(run_dir) if "peak_mem_bytes" in r)
    memory = next(line for line in summary.splitlines() if line.startswith("  memory "))
    assert f"peak RSS {report.human_bytes(peak)} per rank (the worst rank, shared library code included: " in memory
    assert "; estimated " in memory and memory.endswith(" without the library code"), memory
    wandb_line = next(line for line in summary.splitlines() if line.strip().startswith("wandb"))
    assert str(run_dir / "wandb" / "offline-run-") in wandb_line and "wandb sync" in wandb_line


@pytest.mark.multiproc
def test_plot_renders_a_real_run_and_compares_runs(observed, tmp_path):
    from PIL import Image
    run_dir = observed[0]
    single = tmp_path / "one.png"
    assert zerotrain(["plot", str(run_dir), "-o", str(single)]) == 0
    img = Image.open(single)
    assert img.format == "PNG" and img.width > 3 * img.height  # loss | lr | throughput | mfu side by side
    assert len(set(img.convert("L").getdata())) > 20  # drawn curves and text, not a blank canvas

    other = tmp_path / "copy" / "run"  # a second run dir holding the same real metrics
    other.mkdir(parents=True)
    shutil.copy(run_dir / "metrics.jsonl", other / "metrics.jsonl")
    both = tmp_path / "both.png"
    assert zerotrain(["plot", str(run_dir), str(other), "-o", str(both)]) == 0
    assert both.stat().st_size > single.stat().st_size * 0.8


def test_plot_missing_metrics_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        zerotrain(["plot", str(tmp_path)])
    assert e.value.code == 2
    assert f"{tmp_path}: no metrics.jsonl here" in capsys.readouterr().err


def test_plot_series_keep_the_continued_training_after_a_resume(tmp_path):
    """metrics.jsonl appends: after a crash at step 3 and a resume from the step-2 checkpoint,
    step 3 appears twice; the curve must use the rows of the training that continued."""
    from zerotrain.train.commands.plot import read_series
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 3, "loss": 2.4},
            {"step": 3, "loss": 2.2}, {"step": 4, "loss": 2.0, "lr": 1e-3}, {"step": 4, "val/loss": "nan"}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + '\n{"step": 5, "lo')
    s = read_series(tmp_path)
    assert s["loss"] == ([1, 2, 3, 4], [3.0, 2.5, 2.2, 2.0])
    assert s["lr"] == ([4], [1e-3]) and "val/loss" not in s


def test_memory_line_puts_the_planned_peak_against_the_budget():
    from types import SimpleNamespace as NS
    budget = NS(bytes=8 * 2**30, source="the memory cgroup limit of /sys/fs/cgroup/job")
    from zerotrain.train.plan.memory_plan import MemoryPlan
    t = MemoryPlan(budget, None, NS(device_total=3 * 2**30, device_kind="cuda"), "")
    assert report._memory_text(t) == ("estimated peak 3.00 GiB of 8.00 GiB per rank (38%): "
                                      "the memory cgroup limit of /sys/fs/cgroup/job; counts tensors, not the CUDA "
                                      "context or the allocator's cache")
    # On a CPU the estimate is owned memory: the library code in top's RES is named beside it.
    t = MemoryPlan(budget, None, NS(device_total=584 * 2**20, device_kind="cpu"), "")
    assert report._memory_text(t, 480 * 2**20) == (
        "estimated peak 584.00 MiB of 8.00 GiB per rank (7%): the memory cgroup limit of /sys/fs/cgroup/job; "
        "counts the memory a rank owns, not the 480.00 MiB of shared library code that top's RES adds")
    assert report._memory_text(MemoryPlan(budget, None, None, "")) == \
        "budget 8.00 GiB per rank: the memory cgroup limit of /sys/fs/cgroup/job"
    assert report._memory_text(MemoryPlan(None, None, None, "")) == "budget not checked (distributed.memory_check false)"


def test_progress_line_and_durations():
    m = {"loss": 2.34567, "lr": 3e-4, "tokens_per_s": 12_345.0, "samples_per_s": 1.0, "mfu": 0.4123,
         "step_time_s": 1.5}
    assert report.progress_line(m, 100, 4100) == "step 100/4100  loss 2.3457  lr 0.0003  12.35k tok/s  mfu 41.2%  eta 1h40m"
    assert report.duration(75) == "1m15s" and report.duration(3.25) == "3.2s"


def test_only_torchs_deprecations_of_deepspeeds_two_collectives_are_silenced():
    """In this process, through torch's real wrappers (they warn before failing without a process
    group): the two calls DeepSpeed makes are silent, another deprecation of the same torch module
    and the same text as another category still warn. The launch-level check (ZeRO-3's stderr) is
    tests/test_stages.py's."""
    import warnings

    import torch
    import torch.distributed as dist

    from zerotrain.train.launch import library_warnings
    t = torch.zeros(2)

    def warned(call) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.resetwarnings()
            warnings.simplefilter("always")
            library_warnings.quiet()
            try:
                call()
            except (RuntimeError, ValueError):
                pass  # no default process group: the deprecation has warned by then
        return [f"{w.category.__name__}: {w.message}" for w in seen]

    assert warned(lambda: dist.all_gather_into_tensor(t, t)) == []
    assert warned(lambda: dist.reduce_scatter_tensor(t, t)) == []
    other = warned(lambda: dist._all_gather_base(t, t))
    assert other and other[0].startswith("FutureWarning: `torch.distributed._all_gather_base`"), other
    same_text = warned(lambda: warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated.", UserWarning))
    assert same_text == ["UserWarning: `torch.distributed.all_gather_into_tensor` is deprecated."]
