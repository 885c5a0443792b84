"""bench/gpu_check.sh (the CUDA checks) as far as a CPU machine can run it: the whole script
with --dry-run (tiny models, fp32, synthetic fp16 metrics), and its checkers on metrics that
must FAIL (a constant loss scale, disagreeing losses, MFU under the target, a planner that
underestimates the peak)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, subprocess_env

CHECKS = REPO / "bench" / "gpu_checks.py"
FP16_CFGS = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2")  # gpu_check.sh's fp16 rows
sys.path.insert(0, str(REPO / "bench"))
import gpu_checks  # noqa: E402


def checker(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """bench/gpu_checks.py as gpu_check.sh calls it, recording into tmp_path/gpu_check.json."""
    env = subprocess_env({"GPU_CHECK_JSON": str(tmp_path / "gpu_check.json")})
    return subprocess.run([sys.executable, str(CHECKS), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def recorded(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "gpu_check.json").read_text())["checks"][name]


def write_metrics(run_dir: Path, rows: list[dict]):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


# ----------------------------------------------------------------------------- the checkers
def test_fp16_checker_passes_a_changing_scale_with_skipped_steps(tmp_path):
    checker(tmp_path, "synth-fp16", str(tmp_path / "run"))
    r = checker(tmp_path, "fp16", "fp16_x", str(tmp_path / "run"))
    assert r.returncode == 0 and r.stdout.startswith("PASS fp16_x "), r.stdout + r.stderr
    f = recorded(tmp_path, "fp16_x")["figures"]
    # overflows halve the scale (skipped steps), then 20 clean steps double it again
    assert f["scale_min"] < f["scale_first"] < 2.0 ** 24 and f["skipped_steps"] > 0
    assert f["scale_decreases"] >= 1 and f["scale_increases"] >= 1
    assert f["last_loss"] < f["first_loss"]


def test_fp16_checker_fails_a_constant_scale(tmp_path):
    checker(tmp_path, "synth-fp16", str(tmp_path / "run"), "--constant-scale")
    r = checker(tmp_path, "fp16", "fp16_const", str(tmp_path / "run"))
    assert r.returncode == 1 and r.stdout.startswith("FAIL fp16_const "), r.stdout + r.stderr
    assert "never changed" in r.stdout and "skipped_steps stayed 0" in r.stdout
    assert recorded(tmp_path, "fp16_const")["ok"] is False
    assert (tmp_path / "checks.txt").read_text() == r.stdout


def test_fp16_checker_fails_when_overflows_are_not_counted(tmp_path):
    """GradScaler lowered the scale (overflows) but the trainer logged skipped_steps 0."""
    rows = [{"step": s, "loss": 5.0 - 0.1 * s, "loss_scale": 2.0 ** (24 - min(s, 8)), "skipped_steps": 0}
            for s in range(2, 30, 2)]
    write_metrics(tmp_path / "run", rows)
    r = checker(tmp_path, "fp16", "fp16_ddp", str(tmp_path / "run"))
    assert r.returncode == 1 and "although the loss scale fell" in r.stdout, r.stdout


def test_fp16_checker_fails_a_missing_scale_and_a_flat_loss(tmp_path):
    write_metrics(tmp_path / "a", [{"step": s, "loss": 5.0, "skipped_steps": 1} for s in (2, 4, 6)])
    r = checker(tmp_path, "fp16", "a", str(tmp_path / "a"))
    assert r.returncode == 1 and "loss_scale missing" in r.stdout
    write_metrics(tmp_path / "b", [{"step": s, "loss": 5.0, "loss_scale": 2.0 ** (20 - s), "skipped_steps": s}
                                   for s in (2, 4, 6)])
    r = checker(tmp_path, "fp16", "b", str(tmp_path / "b"))
    assert r.returncode == 1 and "loss did not fall" in r.stdout


def test_agreement_checker(tmp_path):
    base = [5.5, 4.0, 3.2, 2.9, 2.7]
    for cfg, scale in (("ddp", 1.0), ("zero2", 1.004), ("zero3", 0.996)):
        write_metrics(tmp_path / cfg, [{"step": 5 * (i + 1), "loss": v * scale} for i, v in enumerate(base)])
    runs = [f"{c}={tmp_path / c}" for c in ("ddp", "zero2", "zero3")]
    r = checker(tmp_path, "agree", "agree_ok", *runs)
    assert r.returncode == 0, r.stdout
    f = recorded(tmp_path, "agree_ok")["figures"]
    assert f["max_rel_spread"] == pytest.approx(1.004 / 0.996 - 1) and f["rtol"] == gpu_checks.BF16_RTOL
    # one stage 5% off at one step: FAIL, naming the step and the pair
    rows = [{"step": 5 * (i + 1), "loss": v * (1.05 if i == 3 else 1.0)} for i, v in enumerate(base)]
    write_metrics(tmp_path / "zero3", rows)
    r = checker(tmp_path, "agree", "agree_bad", *runs)
    assert r.returncode == 1 and "at step 20 (ddp vs zero3)" in r.stdout, r.stdout
    # a run that logged fewer steps (crashed half-way) does not pass either
    write_metrics(tmp_path / "zero3", [{"step": 5, "loss": 5.5}, {"step": 10, "loss": 4.0}])
    assert checker(tmp_path, "agree", "agree_short", *runs).returncode == 1


def test_mfu_checker_reports_a_miss_with_its_number(tmp_path):
    from zerotrain.models.gpt import preset
    fpt = preset("gpt2-124m").flops_per_token(1024)
    tps = 0.42 * 989e12 / fpt  # 42% MFU on an H200
    rows = [{"step": 10 * i, "loss": 10.0 - 0.1 * i, "tokens_per_s": tps, "mfu": 0.42, "step_time_s": 0.1}
            for i in range(1, 6)]
    write_metrics(tmp_path / "run", rows)
    r = checker(tmp_path, "mfu", "mfu_trainer", str(tmp_path / "run"), "--target", "0.5")
    assert r.returncode == 1 and "MFU 42.0% is below the 50% target" in r.stdout, r.stdout
    f = recorded(tmp_path, "mfu_trainer")["figures"]
    assert f["flops_per_token"] == fpt and f["peak_flops"] == pytest.approx(989e12)
    assert checker(tmp_path, "mfu", "mfu_low_target", str(tmp_path / "run"), "--target", "0.4").returncode == 0


def _stages(tmp_path: Path, planned: int, peak: int, trainer_tps: float, minimal_tps: float) -> Path:
    d = tmp_path / "stages"
    d.mkdir(exist_ok=True)
    trainer = {"planned_peak_bytes": planned, "first_loss": 5.0, "last_loss": 3.0,
               "measured_model_states_per_rank": [100], "planned_model_states_per_rank": [100]}
    res = {"config": "zero2", "trainer": [trainer],
           "minimal": [{"peak_bytes_per_rank": [peak - 10]}], "peak_bytes_per_rank": [peak],
           "trainer_tokens_per_s": trainer_tps, "minimal_tokens_per_s": minimal_tps,
           "throughput_ratio": trainer_tps / minimal_tps, "trainer_overhead": 1 - trainer_tps / minimal_tps}
    (d / "stages-20260101-000000.json").write_text(json.dumps({"meta": {"model": "m", "precision": "json"},
                                                               "results": [res]}))
    return d


def test_stage_and_plan_checkers(tmp_path):
    d = _stages(tmp_path, planned=2000, peak=1500, trainer_tps=990.0, minimal_tps=1000.0)
    assert checker(tmp_path, "stage", "stage_zero2", str(d)).returncode == 0
    assert checker(tmp_path, "plan", "plan_zero2", str(d)).returncode == 0
    d = _stages(tmp_path, planned=1000, peak=1500, trainer_tps=900.0, minimal_tps=1000.0)
    r = checker(tmp_path, "stage", "stage_zero2", str(d))
    assert r.returncode == 1 and "overhead 10.0% > 3%" in r.stdout, r.stdout
    r = checker(tmp_path, "plan", "plan_zero2", str(d))
    assert r.returncode == 1 and "below the measured peak" in r.stdout
    assert recorded(tmp_path, "plan_zero2")["figures"]["planner_error"] == pytest.approx(-1 / 3)


def test_async_checkpoint_checker_fails_a_slow_snapshot_a_missing_save_and_a_changed_resume(tmp_path):
    """Save 2's write still ran at save 4 (0.2 s waited: in save 4's blocked time and in save 2's
    wait_s), save 6's snapshot alone took longer than its write; no checkpoint was committed; the
    resumed run's first loss is off in the last bit. The dry run (test_dry_run) is the PASS case."""
    losses = {s: 5.0 - 0.1 * s for s in range(1, 8)}
    saves = [(2, 0.01, 0.1, 0.2), (4, 0.25, 0.1, 0.2), (6, 0.15, 0.1, 0.0)]  # step, save_s, write_s, wait_s
    rows = [{"step": s, "loss": v} for s, v in losses.items()]
    rows += [{"step": s + 1, "checkpoint/step": s, "checkpoint/save_s": b, "checkpoint/write_s": w,
              "checkpoint/wait_s": wt, "checkpoint/bytes": 100} for s, b, w, wt in saves]
    write_metrics(tmp_path / "async", sorted(rows, key=lambda r: r["step"]))
    write_metrics(tmp_path / "resume", [{"step": s, "loss": math.nextafter(v, 0) if s == 5 else v}
                                        for s, v in losses.items() if s > 4])
    write_metrics(tmp_path / "sync", [{"step": s, "loss": v} for s, v in losses.items()])
    r = checker(tmp_path, "ckpt-async", "ckpt_async", *(str(tmp_path / d) for d in ("async", "resume", "sync")),
                "--steps", "2,4,6", "--resume-from", "4", "--require-faster")
    assert r.returncode == 1 and r.stdout.startswith("FAIL ckpt_async "), r.stdout + r.stderr
    assert "latest is missing, not step_00000006" in r.stdout
    assert "background write at steps [6]" in r.stdout          # save 4's 0.25 s was mostly the wait
    assert "the first loss" in r.stdout
    f = recorded(tmp_path, "ckpt_async")["figures"]
    assert f["waited_before_s"] == [0.0, 0.2, 0.0] and f["snapshot_s"] == pytest.approx([0.01, 0.05, 0.15])
    assert f["saves"] == [2, 4, 6] and f["sync_equal"] and not f["resume_first_equal"]


def test_failed_launch_names_the_timeout_and_the_error(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("starting\nRuntimeError: CUDA error: out of memory\nsome teardown noise\n")
    r = checker(tmp_path, "failed", "bf16_zero3", "124", "150", str(log))
    assert r.returncode == 1 and "timed out after 150s: RuntimeError: CUDA error: out of memory" in r.stdout


@pytest.mark.parametrize("cfg", ["ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2"])
def test_fp16_json_of_every_shipped_config_is_accepted_on_a_gpu(tmp_path, cfg):
    """What gpu_check.sh runs: the shipped file, bf16 switched to fp16, starting at 2^24."""
    out = tmp_path / f"{cfg}_fp16.json"
    gpu_checks.ds_json(REPO / "ds_configs" / f"{cfg}.json", out, "fp16", 24, 20)
    d = json.loads(out.read_text())
    assert d["fp16"]["enabled"] and not d["bf16"]["enabled"] and "data_types" not in d
    assert d["fp16"]["initial_scale_power"] == 24 and d["fp16"]["loss_scale_window"] == 20
    got = gpu_checks.validate_ds(out, ["--model.name", "gpt-tiny"], cuda=True)
    assert got["precision"] == "fp16" and got["backend"] == {"ddp": "ddp", "fsdp2": "fsdp2"}.get(cfg, "deepspeed")


def test_token_file_is_what_training_reads(tmp_path):
    from zerotrain.train.data.tokens import TokenFile
    meta = gpu_checks.write_tokens(tmp_path / "t.bin", vocab=50304, n=100_000, seed=0)
    f = TokenFile(tmp_path / "t.bin", None)
    assert f.num_tokens == 100_000 and f.vocab_size == 50304 and f.max_token == meta["max_token"] < 50304
    # random-ish, not uniform: a unigram model already beats ln(vocab), so the loss can fall
    counts = __import__("numpy").bincount(f.tokens, minlength=50304) / f.num_tokens
    entropy = -sum(p * math.log(p) for p in counts if p > 0)
    assert entropy < 0.8 * math.log(50304)


# ----------------------------------------------------------------------------- the whole script
@pytest.mark.multiproc
def test_dry_run(tmp_path):
    out = tmp_path / "out"
    env = subprocess_env({"OUT": str(out), "PYTHON": sys.executable})
    p = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=900)
    lines = [ln for ln in p.stdout.splitlines() if re.match(r"(PASS|FAIL) ", ln)]
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    want = ["env", *[f"fp16_{c}" for c in FP16_CFGS],
            *[f"bf16_{c}" for c in ("ddp", "zero0", "zero3")], "bf16_agree", "ckpt_async", "mfu_trainer",
            "mfu_independent", "stage_zero2"]
    assert sorted(ln.split()[1] for ln in lines) == sorted(want), lines
    assert all(ln.startswith("PASS ") for ln in lines), lines
    assert (out / "checks.txt").read_text().splitlines() == lines

    doc = json.loads((out / "gpu_check.json").read_text())
    checks = {k: v["figures"] for k, v in doc["checks"].items()}
    assert doc["summary"] == {**doc["summary"], "passed": len(want), "failed": 0}
    assert doc["meta"]["mode"] == "dry-run" and doc["meta"]["env"]["deepspeed"]

    # fp16: the written JSONs were validated as on a GPU; the synthetic metrics carry a scale
    # change and skipped steps
    for c in FP16_CFGS:
        f = checks[f"fp16_{c}"]
        assert f["synthetic"] and f["validated"][f"{c}_fp16"]["precision"] == "fp16"
        assert f["scale_min"] < f["scale_first"] and f["skipped_steps"] > 0
        ds = json.loads((out / "configs" / f"{c}_fp16.json").read_text())
        assert ds["fp16"]["enabled"] and not ds["bf16"]["enabled"] and "data_types" not in ds

    # bf16 (fp32 here): the agreement check compared exactly what each run logged
    agree = checks["bf16_agree"]
    for c in ("ddp", "zero0", "zero3"):
        assert agree["losses"][c] == checks[f"bf16_{c}"]["losses"]
        assert checks[f"bf16_{c}"]["last_loss"] < checks[f"bf16_{c}"]["first_loss"]
    assert agree["max_rel_spread"] == pytest.approx(max(agree["rel_spread_per_step"]), abs=1e-6)
    assert agree["max_rel_spread"] < 1e-4  # fp32: the stages differ by summation order only

    # checkpoint.async: saves 2, 4, 6 committed with their blocked and write times; the resume
    # from step 4 logged the async run's losses, and the sync run matched it (fp32 on CPU)
    c = checks["ckpt_async"]
    assert c["saves"] == [2, 4, 6] and len(c["save_s"]) == len(c["write_s"]) == 3
    assert all(x > 0 for x in c["save_s"] + c["write_s"]) and c["snapshot_bytes"] > 0
    assert c["resume_first_equal"] and c["resume_equal"] and c["sync_equal"] and c["sync_sha_equal"]
    assert c["resumed_losses"] == c["async_losses"][4:7] and len(c["async_losses"]) == 7
    assert c["snapshot_s"] == [b - w for b, w in zip(c["save_s"], c["waited_before_s"])]
    assert c["sync_losses"] == c["async_losses"]
    ckpts = out / "runs" / "ckpt_async" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000006"
    rows = [json.loads(ln) for ln in (out / "runs" / "ckpt_async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["checkpoint/write_s"] for r in rows if "checkpoint/write_s" in r] == c["write_s"]

    # MFU: the trainer's figure and the independent timing use the same FLOPs and peak
    from zerotrain.models.gpt import preset
    fpt = preset("gpt-tiny", vocab_size=512).flops_per_token(64)
    t, ind = checks["mfu_trainer"], checks["mfu_independent"]
    assert t["flops_per_token"] == ind["flops_per_token"] == fpt
    assert t["peak_flops"] == pytest.approx(2e11) and ind["peak_flops"] == pytest.approx(2e11)
    assert t["mfu"] == pytest.approx(t["tokens_per_s"] * fpt / 2e11, rel=1e-6)
    assert ind["mfu"] == pytest.approx(ind["tokens_per_s"] * fpt / 2e11, rel=1e-6)
    assert ind["trainer_vs_independent"] == pytest.approx(t["tokens_per_s"] / ind["tokens_per_s"])

    # stages: the ratio is the trainer's tokens/s over the minimal loop's, from bench/stages.py
    s = checks["stage_zero2"]
    assert s["throughput_ratio"] == pytest.approx(s["trainer_tokens_per_s"] / s["minimal_tokens_per_s"])
    assert s["peak_bytes"] > 0 and s["config"] == "zero2"
    assert (out / "summary.md").read_text().count("| PASS |") == len(want)
