"""The checks of bench/gpu_check.sh: each reads what a run wrote, prints one line
`PASS name key=value ...` or `FAIL name reason ...`, appends it to <out>/checks.txt and
records the figures in <out>/gpu_check.json (rewritten after every check, under a lock, so
jobs running side by side can record at the same time). Also the helpers the script needs:
DeepSpeed JSON variants, a synthetic token file, synthetic fp16 metrics for the dry run.

    python bench/gpu_checks.py <command> ...     # commands: see `--help`; standard library only
                                                  # (validate-ds and tokens import zerotrain / numpy)
The JSON file is $GPU_CHECK_JSON (default <cwd>/gpu_check.json). Exit status: 0 PASS, 1 FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# bf16 loss agreement between DDP and ZeRO-0..3 (same model, data, seed, one process): the
# largest relative spread (max - min) / min of the logged (interval-mean) losses at any
# logged step. Why 2%: the runs differ only in rounding (bf16 has an 8-bit mantissa; DDP keeps
# fp32 weights under autocast while DeepSpeed computes with bf16 weights and fp32 masters;
# ZeRO-0's file has no fp32 "data_types", so its gradients stay bf16), and rounding differences
# grow along the trajectory. Measured on CPU in bf16 (gpt-tiny d_model 128 x 4 layers, seq 64,
# micro 16, lr 1e-3, 80 steps, 16 logged steps): DDP and ZeRO-1/2/3 within 0.11% of each
# other, ZeRO-0 up to 0.70% away (BENCHMARKS.md, GPU). 2% is ~3x that. The bugs this check is
# for move the loss by far more: a gradient scaled by the world size or the accumulation,
# clipping or the lr schedule not applied, a stage not stepping some parameters.
BF16_RTOL = 0.02


# ----------------------------------------------------------------------------- recording
def json_path() -> Path:
    return Path(os.environ.get("GPU_CHECK_JSON", "gpu_check.json"))


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _update(fn) -> dict:
    """Read-modify-write the JSON file atomically (a reader never sees half a file)."""
    path = json_path()
    with _locked(path):
        doc = json.loads(path.read_text()) if path.is_file() else {"meta": {}, "checks": {}}
        fn(doc)
        checks = doc["checks"].values()
        doc["summary"] = {"passed": sum(c["ok"] for c in checks), "failed": sum(not c["ok"] for c in checks),
                          "updated": time.strftime("%Y-%m-%d %H:%M:%S")}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=_plain) + "\n")
        os.replace(tmp, path)
    return doc


def _plain(o):
    return float(o) if hasattr(o, "__float__") else str(o)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt(x) for x in v) + "]"
    return str(v)


def record(name: str, ok: bool, why: str = "", figures: dict | None = None, shown=()) -> int:
    """Print and record one check. `shown`: the figures that go on the line (all go in the JSON)."""
    figures = figures or {}
    line = " ".join(["PASS" if ok else "FAIL", name, *[f"{k}={_fmt(figures[k])}" for k in shown if k in figures]])
    if why:
        line += f" -- {why}"
    line = line.replace("\n", " ")[:3000]
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: jobs running side by side don't interleave
    with _locked(json_path()):
        with open(json_path().with_name("checks.txt"), "a") as f:
            f.write(line + "\n")

    def put(doc):
        doc["checks"][name] = {"ok": ok, "line": line, "why": why, "figures": figures,
                               "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    _update(put)
    return 0 if ok else 1


# ----------------------------------------------------------------------------- metrics
def read_rows(run_dir: Path) -> list[dict]:
    f = Path(run_dir) / "metrics.jsonl"
    if not f.is_file():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def train_rows(rows: list[dict]) -> list[dict]:
    """The per-interval training rows (not the memory, validation or final summary rows)."""
    return [r for r in rows if "loss" in r and "step" in r and not any(k.startswith("final/") for k in r)]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _loss_fell(train: list[dict], min_drop: float) -> tuple[bool, str]:
    first, last = train[0]["loss"], train[-1]["loss"]
    if not all(_finite(r["loss"]) for r in train):
        return False, "non-finite loss logged"
    if last > first * (1 - min_drop):
        return False, f"loss did not fall by {min_drop:.0%} ({first:.4f} -> {last:.4f})"
    return True, ""


def check_fp16(name: str, run_dir: Path, min_drop: float = 0.1, note: str = "", extra: dict | None = None) -> int:
    """fp16 with dynamic loss scaling: the scale is logged at every interval and changes, at
    least one overflowing step was skipped (skipped_steps > 0), and the loss falls."""
    train = train_rows(read_rows(run_dir))
    fig = {"run_dir": str(run_dir), **(extra or {})}
    if not train:
        return record(name, False, f"no training rows in {run_dir}/metrics.jsonl", fig)
    scales = [r.get("loss_scale") for r in train]
    skipped = [r.get("skipped_steps") for r in train]
    fig.update(steps=train[-1]["step"], first_loss=train[0]["loss"], last_loss=train[-1]["loss"],
               loss_scales=scales, skipped_steps=max((s for s in skipped if isinstance(s, int)), default=None))
    shown = ("steps", "first_loss", "last_loss", "scale_first", "scale_min", "scale_max", "scale_last",
             "skipped_steps")
    if not all(_finite(s) and s > 0 for s in scales):
        return record(name, False, "loss_scale missing from some metrics.jsonl rows", fig, shown)
    fig.update(scale_first=scales[0], scale_min=min(scales), scale_max=max(scales), scale_last=scales[-1],
               scale_changes=sum(a != b for a, b in zip(scales, scales[1:])),
               scale_decreases=sum(b < a for a, b in zip(scales, scales[1:])),
               scale_increases=sum(b > a for a, b in zip(scales, scales[1:])))
    problems = []
    if len(set(scales)) < 2:
        problems.append(f"the loss scale never changed ({scales[0]:g} at every logged step)")
    if not fig["skipped_steps"]:
        drop = " although the loss scale fell (overflows)" if fig["scale_decreases"] else ""
        problems.append(f"skipped_steps stayed {fig['skipped_steps']}{drop}: no overflowing step was counted")
    ok, why = _loss_fell(train, min_drop)
    if not ok:
        problems.append(why)
    return record(name, not problems, "; ".join(problems) or note, fig, shown)


def check_run(name: str, run_dir: Path, min_drop: float = 0.1, note: str = "", extra: dict | None = None) -> int:
    """A run finished with finite losses that fell."""
    rows = read_rows(run_dir)
    train = train_rows(rows)
    fig = {"run_dir": str(run_dir), **(extra or {})}
    if not train:
        return record(name, False, f"no training rows in {run_dir}/metrics.jsonl", fig)
    tps = [r["tokens_per_s"] for r in train[1:] if "tokens_per_s" in r]
    fig.update(steps=train[-1]["step"], first_loss=train[0]["loss"], last_loss=train[-1]["loss"],
               losses=[r["loss"] for r in train], tokens_per_s=statistics.median(tps) if tps else None,
               peak_mem_bytes=max((r.get("peak_mem_bytes") or 0 for r in train), default=None))
    shown = ("steps", "first_loss", "last_loss", "tokens_per_s")
    ok, why = _loss_fell(train, min_drop)
    return record(name, ok, why or note, fig, shown)


def check_agree(name: str, runs: dict[str, Path], rtol: float, note: str = "") -> int:
    """Same model, data and seed under each config: the logged losses agree at every logged step."""
    losses = {}
    for cfg, d in runs.items():
        train = train_rows(read_rows(d))
        losses[cfg] = {r["step"]: r["loss"] for r in train}
    fig = {"rtol": rtol, "losses": {c: list(v.values()) for c, v in losses.items()},
           "steps": sorted(set.intersection(*(set(v) for v in losses.values()))) if losses else []}
    missing = [c for c, v in losses.items() if not v]
    if missing:
        return record(name, False, f"no training rows for {', '.join(missing)}", fig)
    steps = fig["steps"]
    if len(steps) < 3 or any(len(v) != len(steps) for v in losses.values()):
        return record(name, False, f"the runs logged different steps ({ {c: len(v) for c, v in losses.items()} })", fig)
    spreads = []
    for s in steps:
        vals = {c: v[s] for c, v in losses.items()}
        lo, hi = min(vals, key=vals.get), max(vals, key=vals.get)
        spreads.append(((vals[hi] - vals[lo]) / abs(vals[lo]), s, lo, hi))
    worst = max(spreads)
    fig.update(max_rel_spread=worst[0], at_step=worst[1], lowest=worst[2], highest=worst[3],
               rel_spread_per_step=[round(x[0], 6) for x in spreads],
               final_losses={c: v[steps[-1]] for c, v in losses.items()})
    shown = ("max_rel_spread", "at_step", "lowest", "highest", "rtol")
    ok = worst[0] <= rtol and all(_finite(x) for v in losses.values() for x in v.values())
    why = note if ok else f"losses differ by {worst[0]:.2%} > {rtol:.0%} at step {worst[1]} ({worst[2]} vs {worst[3]})"
    return record(name, ok, why, fig, shown)


def _flops_per_token(model: str, overrides: dict, seq_len: int) -> int:
    sys.path.insert(0, str(REPO))
    from zerotrain.models.gpt import preset
    return preset(model, **overrides).flops_per_token(seq_len)


def check_mfu(name: str, run_dir: Path, target: float, skip_windows: int, model: str, overrides: dict,
              seq_len: int, note: str = "") -> int:
    """The trainer's own MFU (metrics.jsonl "mfu", median over the windows after the first
    `skip_windows`, which hold start-up and compilation) against the target."""
    train = train_rows(read_rows(run_dir))[skip_windows:]
    fig = {"run_dir": str(run_dir), "target": target, "model": model, **overrides, "seq_len": seq_len}
    if not train:
        return record(name, False, f"no training rows after the first {skip_windows} in {run_dir}/metrics.jsonl", fig)
    mfu = [r["mfu"] for r in train if "mfu" in r]
    tps = [r["tokens_per_s"] for r in train if "tokens_per_s" in r]
    fig.update(mfu_windows=mfu, tokens_per_s_windows=tps, first_loss=train[0]["loss"], last_loss=train[-1]["loss"],
               flops_per_token=_flops_per_token(model, overrides, seq_len),
               peak_mem_bytes=max((r.get("peak_mem_bytes") or 0 for r in train), default=None),
               reserved_mem_bytes=max((r.get("reserved_mem_bytes") or 0 for r in train), default=None) or None,
               step_time_s=statistics.median(r["step_time_s"] for r in train if "step_time_s" in r))
    if not tps:
        return record(name, False, "no tokens_per_s in metrics.jsonl", fig)
    fig["tokens_per_s"] = statistics.median(tps)
    fig["model_flops_per_s"] = fig["tokens_per_s"] * fig["flops_per_token"]
    shown = ("mfu", "tokens_per_s", "model_flops_per_s", "peak_flops", "target")
    if not mfu:
        return record(name, False, "the trainer logged no mfu (unknown device peak: set logging.peak_flops)", fig,
                      shown)
    fig["mfu"] = statistics.median(mfu)
    fig["peak_flops"] = fig["model_flops_per_s"] / fig["mfu"]  # what the trainer divided by
    ok = fig["mfu"] >= target
    return record(name, ok, note if ok else f"MFU {fig['mfu']:.1%} is below the {target:.0%} target", fig, shown)


def check_mfu_independent(name: str, result: Path, mode: str, target: float, trainer_check: str | None,
                          note: str = "") -> int:
    """bench/gpu_mfu.py's timing (model built directly, no trainer) against the target; the
    trainer's tokens/s from `trainer_check` is compared with it (the trainer's overhead)."""
    fig = {"result": str(result), "target": target, "mode": mode}
    if not result.is_file():
        return record(name, False, f"{result} missing (bench/gpu_mfu.py failed; see its log)", fig)
    d = json.loads(result.read_text())
    fig.update({k: d.get(k) for k in ("device", "model", "params", "flops_per_token", "peak_flops", "micro_batch",
                                      "seq_len", "dtype")})
    fig["modes"] = d.get("modes", {})
    m = fig["modes"].get(mode) or {}
    shown = ("mfu", "tokens_per_s", "step_s", "trainer_vs_independent", "target")
    if "error" in m or "mfu" not in m:
        return record(name, False, f"mode {mode}: {m.get('error', 'not measured')}", fig, shown)
    fig.update(mfu=m["mfu"], tokens_per_s=m["tokens_per_s"], step_s=m["step_s"])
    if trainer_check:
        path = json_path()
        t = json.loads(path.read_text())["checks"].get(trainer_check, {}).get("figures", {}) if path.is_file() else {}
        if t.get("tokens_per_s"):
            fig["trainer_vs_independent"] = t["tokens_per_s"] / m["tokens_per_s"]
    ok = m["mfu"] >= target
    return record(name, ok, note if ok else f"MFU {m['mfu']:.1%} is below the {target:.0%} target", fig, shown)


def _stages_result(stages_dir: Path) -> dict | None:
    files = sorted(stages_dir.glob("stages-*.json"))
    if not files:
        return None
    doc = json.loads(files[-1].read_text())
    return {"meta": doc["meta"], **doc["results"][0]}


def check_stage(name: str, stages_dir: Path, min_ratio: float, note: str = "") -> int:
    """bench/stages.py for one config: trainer tokens/s over the minimal deepspeed loop's (the
    trainer's overhead) and per-rank peak memory; the ratio must reach `min_ratio`."""
    r = _stages_result(stages_dir)
    fig = {"stages_dir": str(stages_dir), "min_ratio": min_ratio}
    if r is None:
        return record(name, False, f"no stages-*.json in {stages_dir} (bench/stages.py failed; see its log)", fig)
    t = r["trainer"][-1]
    fig.update(config=r["config"], model=r["meta"]["model"], precision=r["meta"]["precision"],
               trainer_tokens_per_s=r.get("trainer_tokens_per_s"), minimal_tokens_per_s=r.get("minimal_tokens_per_s"),
               throughput_ratio=r.get("throughput_ratio"), trainer_overhead=r.get("trainer_overhead"),
               trainer_mfu=t.get("mfu"), peak_bytes=(r.get("peak_bytes_per_rank") or [None])[0],
               minimal_peak_bytes=(r["minimal"][-1].get("peak_bytes_per_rank") or [None])[0],
               planned_peak_bytes=t.get("planned_peak_bytes"),
               model_states_bytes=(t.get("measured_model_states_per_rank") or [None])[0],
               planned_model_states_bytes=(t.get("planned_model_states_per_rank") or [None])[0],
               first_loss=t.get("first_loss"), last_loss=t.get("last_loss"))
    shown = ("trainer_tokens_per_s", "minimal_tokens_per_s", "throughput_ratio", "peak_bytes", "planned_peak_bytes",
             "trainer_mfu")
    ratio = fig["throughput_ratio"]
    if ratio is None:
        return record(name, False, "no throughput ratio (a run logged no timed window)", fig, shown)
    ok = ratio >= min_ratio
    why = note if ok else (f"the trainer runs at {ratio:.3f} of the minimal loop's tokens/s "
                           f"(overhead {1 - ratio:.1%} > {1 - min_ratio:.0%})")
    return record(name, ok, why, fig, shown)


def check_plan(name: str, stages_dir: Path, note: str = "") -> int:
    """The planner's peak per rank (what zerotrain's memory check relies on) covers the
    measured peak of the same run (CUDA max allocated on GPU)."""
    r = _stages_result(stages_dir)
    if r is None:
        return record(name, False, f"no stages-*.json in {stages_dir}", {"stages_dir": str(stages_dir)})
    t = r["trainer"][-1]
    peak, plan = (r.get("peak_bytes_per_rank") or [None])[0], t.get("planned_peak_bytes")
    fig = {"config": r["config"], "peak_bytes": peak, "planned_peak_bytes": plan,
           "planner_error": (plan - peak) / peak if peak and plan else None,
           "model_states_bytes": (t.get("measured_model_states_per_rank") or [None])[0],
           "planned_model_states_bytes": (t.get("planned_model_states_per_rank") or [None])[0]}
    shown = ("peak_bytes", "planned_peak_bytes", "planner_error")
    if not peak or not plan:
        return record(name, False, "peak or planned peak missing", fig, shown)
    ok = plan >= peak
    return record(name, ok, note if ok else "the planner's peak is below the measured peak: the memory check "
                  "would let a run that does not fit start", fig, shown)


def _losses_by_launch(run_dir: Path) -> list[dict[int, float]]:
    """{step: loss} per launch as written (a resumed launch appends rows from an earlier step)."""
    runs, last = [{}], 0
    for r in train_rows(read_rows(run_dir)):
        if r["step"] <= last:
            runs.append({})
        runs[-1][r["step"]] = r["loss"]
        last = r["step"]
    return runs


def _checkpoint_problems(root: Path, steps: list[int]) -> list[str]:
    """What tests/test_async_checkpoint.py asks of committed saves: each step's directory has its
    manifest and every file matches it (size, sha256), `latest` names the last, no `.tmp-` left."""
    sys.path.insert(0, str(REPO))
    from zerotrain.train.checkpoint import files as io
    problems = []
    latest = root / io.LATEST
    want = io.step_dir_name(steps[-1])
    if not latest.is_file() or latest.read_text().strip() != want:
        problems.append(f"latest is {latest.read_text().strip() if latest.is_file() else 'missing'}, not {want}")
    for s in steps:
        d = root / io.step_dir_name(s)
        try:
            m = io.read_manifest(d)
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"step {s}: {e}")
            continue
        bad = [p for n, rec in m["files"].items() if (p := io.check_file(d, n, rec))]
        if m.get("step") != s or io.META not in m["files"] or bad:
            problems.append(f"step {s}: manifest step {m.get('step')}, {len(bad)} damaged files {bad[:1]}")
    tmp = [p.name for p in root.iterdir() if p.name.startswith(io.TMP_PREFIX)] if root.is_dir() else []
    if tmp:
        problems.append(f"half-written saves left: {tmp}")
    return problems


def _tensor_hashes(ckpt: Path) -> dict[str, str]:
    """sha256 of a checkpoint's tensor and RNG files, from its manifest (meta.json, which holds the
    resolved config and so checkpoint.async, left out)."""
    sys.path.insert(0, str(REPO))
    from zerotrain.train.checkpoint import files as io
    return {n: r["sha256"] for n, r in io.read_manifest(ckpt)["files"].items() if n != io.META}


def check_ckpt_async(name: str, async_run: Path, resume_run: Path, sync_run: Path, steps: list[int],
                     resume_from: int, require_faster: bool, strict_sync: bool, note: str = "") -> int:
    """checkpoint.async on one process: every save committed (complete, verified, `latest` on the
    last), checkpoint/save_s (the loop blocked) and checkpoint/write_s (the background write) per
    save from metrics.jsonl, and a resume from the save at `resume_from` (written while the run
    trained on) that logs the same losses, bit for bit, as the asynchronous run did after it.

    require_faster (GPU): blocked < write for every save after the first (the first allocates the
    pinned buffers), the blocked time taken less the wait for the previous save's write (which
    on a GPU may outlast the 2 steps between saves). The resumed run's first loss depends only on the saved state (forward only),
    so it must always be bit-identical; its later losses, the synchronous run's losses and the
    sha256 of its checkpoint files against the asynchronous ones also depend on the backward being
    deterministic: required with strict_sync (CPU), recorded on a GPU."""
    sys.path.insert(0, str(REPO))
    from zerotrain.train.checkpoint import files as io
    fig = {"async_run": str(async_run), "resume_run": str(resume_run), "sync_run": str(sync_run),
           "save_steps": steps, "resume_from": resume_from}
    shown = ("saves", "save_s", "snapshot_s", "write_s", "resume_equal", "sync_equal", "sync_sha_equal")
    problems = _checkpoint_problems(async_run / "checkpoints", steps)
    rows = [r for r in read_rows(async_run) if "checkpoint/write_s" in r]
    fig.update(saves=[r.get("checkpoint/step") for r in rows], save_s=[r["checkpoint/save_s"] for r in rows],
               write_s=[r["checkpoint/write_s"] for r in rows], wait_s=[r.get("checkpoint/wait_s") for r in rows],
               bytes=[r.get("checkpoint/bytes") for r in rows],
               snapshot_bytes=max((r.get("checkpoint/snapshot_bytes") or 0 for r in rows), default=None))
    if fig["saves"] != steps:
        problems.append(f"metrics.jsonl logged async saves at steps {fig['saves']}, expected {steps}")
    # save_s includes the wait for the previous save's write when it was still running (a GPU
    # step is shorter than a write); checkpoint/wait_s of save k is that wait plus the wait when
    # save k itself was flushed, which is the next save's: peel it off to get the snapshot's own cost.
    before = [0.0]
    for w in fig["wait_s"][:-1]:
        before.append(max(0.0, (w or 0.0) - before[-1]))
    fig["waited_before_s"] = before[:len(rows)]
    fig["snapshot_s"] = [b - w for b, w in zip(fig["save_s"], fig["waited_before_s"])]
    slow = [s for s, b, w in zip(fig["saves"][1:], fig["snapshot_s"][1:], fig["write_s"][1:]) if not b < w]
    if require_faster and (slow or len(rows) < 2):
        problems.append(f"the loop was blocked (less the wait for the previous write) at least as long as the "
                        f"background write at steps {slow}")
    ref = _losses_by_launch(async_run)[0]
    resumed = _losses_by_launch(resume_run)[-1]
    after = sorted(s for s in ref if s > resume_from)
    fig.update(async_losses=[ref[s] for s in sorted(ref)], resumed_losses=[resumed.get(s) for s in after],
               resume_first_equal=bool(after) and resumed.get(after[0]) == ref[after[0]],
               resume_equal=bool(after) and sorted(resumed) == after and all(resumed[s] == ref[s] for s in after))
    if not fig["resume_first_equal"]:
        problems.append(f"resumed from step {resume_from}, the first loss {resumed.get(after[0]) if after else None} "
                        f"is not the async run's {ref.get(after[0]) if after else None}")
    elif strict_sync and not fig["resume_equal"]:
        problems.append(f"resumed losses {fig['resumed_losses']} differ from the async run's after step {resume_from}")
    sync = _losses_by_launch(sync_run)[0]
    fig["sync_losses"] = [sync[s] for s in sorted(sync)]
    fig["sync_equal"] = bool(sync) and sync == ref
    try:
        a, b = (_tensor_hashes(r / "checkpoints" / io.step_dir_name(steps[-1])) for r in (async_run, sync_run))
        fig["sync_sha_equal"] = bool(a) and a == b
    except Exception as e:  # noqa: BLE001 - reported
        fig["sync_sha_equal"] = False
        problems.append(f"sync checkpoint: {e}")
    if strict_sync and not fig["sync_equal"]:
        problems.append("the async run's losses differ from the synchronous run's")
    if strict_sync and not fig["sync_sha_equal"]:
        problems.append(f"step {steps[-1]}'s tensor files differ from the synchronous run's (sha256)")
    return record(name, not problems, "; ".join(problems) or note, fig, shown)


def failed(name: str, rc: int, limit: int, log: Path) -> int:
    """A launch that exited non-zero: the exit status and the log line that says why."""
    text = log.read_text(errors="replace").splitlines() if log.is_file() else []
    pat = re.compile(r"(Error|error:|Exception|FAIL|Killed|out of memory)")
    reason = next((ln.strip() for ln in reversed(text) if pat.search(ln)), text[-1].strip() if text else "no output")
    what = f"timed out after {limit}s" if rc in (124, 137) else f"exit {rc}"
    return record(name, False, f"{what}: {reason[:300]} (log {log})", {"rc": rc, "limit_s": limit, "log": str(log)})


# ----------------------------------------------------------------------------- helpers
def ds_json(src: Path, dst: Path, precision: str, initial_scale_power: int | None, loss_scale_window: int | None):
    """ds_configs/<name>.json in another precision. fp16: the file's own fp16 block switched
    on (bf16 off, the bf16 files' fp32 "data_types" dropped), with the scale knobs given."""
    d = json.loads(Path(src).read_text())
    if precision == "fp16":
        d["bf16"] = {"enabled": False}
        d.pop("data_types", None)
        fp16 = dict(d.get("fp16") or {})
        fp16["enabled"] = True
        if initial_scale_power is not None:
            fp16["initial_scale_power"] = initial_scale_power
        if loss_scale_window is not None:
            fp16["loss_scale_window"] = loss_scale_window
        d["fp16"] = fp16
    elif precision == "bf16":
        d["bf16"] = {"enabled": True}
        d["fp16"] = {**(d.get("fp16") or {}), "enabled": False}
    elif precision == "fp32":
        d["bf16"] = {"enabled": False}
        d["fp16"] = {**(d.get("fp16") or {}), "enabled": False}
        d.pop("data_types", None)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text(json.dumps(d, indent=1) + "\n")


def validate_ds(path: Path, train_args: list[str], cuda: bool) -> dict:
    """Resolve a DeepSpeed JSON the way train/training/build.py does (cuda=True: as on a GPU)."""
    sys.path.insert(0, str(REPO))
    from zerotrain.models import resolve as resolve_model
    from zerotrain.train.args import parse_train_args
    from zerotrain.train.config import load_config
    from zerotrain.train.strategy.ds_config import load_ds_setup
    targs = parse_train_args(train_args)
    cfg = load_config(targs.config, targs.overrides)
    batch = cfg.train.batch(1)
    width = resolve_model(cfg.model).hidden_size
    ds = load_ds_setup(str(path), cfg, batch, cfg.train.max_steps, cuda=cuda, hidden_size=width)
    return {"precision": ds.precision, "backend": ds.backend, "stage": ds.settings.zero_stage}


def write_tokens(out: Path, vocab: int, n: int, seed: int):
    """A token file as `zerotrain prepare` writes one (flat uint16 + sidecar) with random-ish
    tokens: a Zipf-like unigram distribution over the vocabulary (a model can learn it, so
    the loss falls from ln(vocab)), permuted ids so frequent tokens are spread over the table."""
    import numpy as np
    rng = np.random.default_rng(seed)
    ranks = np.minimum(rng.zipf(1.2, size=n), vocab) - 1
    ids = rng.permutation(vocab).astype(np.int64)[ranks]
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    tokens = ids.astype(dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens.tofile(out)
    meta = {"format": "zerotrain-tokens", "version": 1, "dtype": np.dtype(dtype).name, "vocab_size": vocab,
            "num_tokens": int(n), "max_token": int(tokens.max()), "tokenizer": "synthetic-zipf", "files": 0}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def synth_fp16(run_dir: Path, constant_scale: bool, steps: int = 40, every: int = 2):
    """metrics.jsonl of an fp16 run as DeepSpeed logs one: the scale starts at 2^24, overflows
    halve it (skipped steps) until it fits, then it grows once per 20 clean steps; or, with
    `constant_scale`, a scale that never moves and nothing skipped (the checker must FAIL it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows, scale, skipped, clean = [], 2.0 ** 24, 0, 0
    for step in range(1, steps + 1):
        if not constant_scale and scale > 2.0 ** 18:  # the gradients overflow fp16 above 2^18
            scale, skipped, clean = scale / 2, skipped + 1, 0
        elif not constant_scale:
            clean += 1
            if clean == 20:
                scale, clean = scale * 2, 0
        if step % every == 0:
            rows.append({"step": step, "time": 1.0 * step, "loss": 5.5 * 0.97 ** step, "lr": 1e-3,
                         "loss_scale": 2.0 ** 16 if constant_scale else scale,
                         "skipped_steps": 0 if constant_scale else skipped, "synthetic": True})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def env_check(expect_cuda: bool, note: str, site: str | None = None) -> int:
    """Versions, the GPU and its peak; FAIL without CUDA (on the GPU machine), without the
    packages a run needs, or when the carried wheels in `site` shadow the machine's own
    torch/accelerate/transformers/safetensors."""
    import platform
    fig = {"python": platform.python_version(), "host_cpus": os.cpu_count()}
    try:
        import torch
        fig.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
                   torch_from=str(Path(torch.__file__).parent.parent))
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            fig.update(device=torch.cuda.get_device_name(0), device_count=torch.cuda.device_count(),
                       device_mem_bytes=p.total_memory, capability=f"{p.major}.{p.minor}")
            sys.path.insert(0, str(REPO))
            from zerotrain.train.observe.perf import device_peak_flops
            fig["peak_flops"] = device_peak_flops()
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return record("env", False, f"import torch failed: {e}", fig)
    for mod in ("deepspeed", "accelerate", "transformers", "safetensors", "pydantic", "wandb"):
        try:
            m = __import__(mod)
            fig[mod] = getattr(m, "__version__", "?")
            fig[f"{mod}_from"] = str(Path(m.__file__).parent.parent)
        except Exception as e:  # noqa: BLE001
            fig[mod] = f"missing ({type(e).__name__})"
    import sysconfig  # the byte-level runs read this Python's standard library sources (train/data/text.py)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    fig["corpus_bytes"] = sum(f.stat().st_size for f in stdlib.rglob("*.py") if "site-packages" not in f.parts)
    shown = ("device", "torch", "cuda", "python", "deepspeed", "accelerate", "transformers")
    problems = []
    if fig["corpus_bytes"] < 4_000_000:
        problems.append(f"only {fig['corpus_bytes']} bytes of standard library sources under {stdlib}: the "
                        f"byte-level runs (data.max_bytes up to 4 MB) need more")
    if expect_cuda and not fig.get("cuda_available"):
        problems.append("no CUDA device visible to torch")
    for mod in ("deepspeed", "accelerate", "transformers", "safetensors"):
        if str(fig[mod]).startswith("missing"):
            problems.append(f"{mod} {fig[mod]}")
    if site:
        shadowed = [m for m in ("torch", "accelerate", "transformers", "safetensors")
                    if str(fig.get(f"{m}_from", "")).startswith(str(Path(site).resolve()))]
        if shadowed:
            problems.append(f"{', '.join(shadowed)} imported from {site} (the carried wheels), not the machine's own")
    if not str(fig["accelerate"]).startswith("1.15"):
        problems.append(f"accelerate {fig['accelerate']} (zerotrain is tested with 1.15)")
    _update(lambda doc: doc["meta"].update(env=fig))
    return record("env", not problems, "; ".join(problems) or note, fig, shown)


def summary(out: Path) -> str:
    doc = json.loads(json_path().read_text())
    lines = ["# zerotrain GPU check", "", f"{doc['summary']['passed']} passed, {doc['summary']['failed']} failed "
             f"({doc['meta'].get('mode', '?')}, {doc['meta'].get('started', '?')}); figures in gpu_check.json", "",
             "| check | result | figures / reason |", "|---|---|---|"]
    for name, c in doc["checks"].items():
        rest = c["line"].split(" ", 2)[2] if c["line"].count(" ") >= 2 else ""
        lines.append(f"| {name} | {'PASS' if c['ok'] else 'FAIL'} | {rest.replace('|', '/')} |")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


# ----------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("fp16"); s.add_argument("name"); s.add_argument("run_dir", type=Path)
    s.add_argument("--min-drop", type=float, default=0.1); s.add_argument("--note", default="")
    s.add_argument("--extra", default="{}", help="JSON object of figures to record with it")
    s = sub.add_parser("run"); s.add_argument("name"); s.add_argument("run_dir", type=Path)
    s.add_argument("--min-drop", type=float, default=0.1); s.add_argument("--note", default="")
    s.add_argument("--extra", default="{}")
    s = sub.add_parser("agree"); s.add_argument("name"); s.add_argument("runs", nargs="+", help="config=run_dir")
    s.add_argument("--rtol", type=float, default=BF16_RTOL); s.add_argument("--note", default="")
    s = sub.add_parser("mfu"); s.add_argument("name"); s.add_argument("run_dir", type=Path)
    s.add_argument("--target", type=float, default=0.5); s.add_argument("--skip-windows", type=int, default=2)
    s.add_argument("--model", default="gpt2-124m"); s.add_argument("--overrides", default="{}")
    s.add_argument("--seq-len", type=int, default=1024); s.add_argument("--note", default="")
    s = sub.add_parser("mfu-independent"); s.add_argument("name"); s.add_argument("result", type=Path)
    s.add_argument("--mode", default="eager"); s.add_argument("--target", type=float, default=0.5)
    s.add_argument("--trainer-check"); s.add_argument("--note", default="")
    s = sub.add_parser("stage"); s.add_argument("name"); s.add_argument("stages_dir", type=Path)
    s.add_argument("--min-ratio", type=float, default=0.97); s.add_argument("--note", default="")
    s = sub.add_parser("plan"); s.add_argument("name"); s.add_argument("stages_dir", type=Path)
    s.add_argument("--note", default="")
    s = sub.add_parser("ckpt-async"); s.add_argument("name"); s.add_argument("async_run", type=Path)
    s.add_argument("resume_run", type=Path); s.add_argument("sync_run", type=Path)
    s.add_argument("--steps", required=True, help="the save steps, comma-separated")
    s.add_argument("--resume-from", type=int, required=True); s.add_argument("--require-faster", action="store_true")
    s.add_argument("--strict-sync", action="store_true"); s.add_argument("--note", default="")
    s = sub.add_parser("failed"); s.add_argument("name"); s.add_argument("rc", type=int)
    s.add_argument("limit", type=int); s.add_argument("log", type=Path)
    s = sub.add_parser("record"); s.add_argument("name"); s.add_argument("result", choices=("pass", "fail"))
    s.add_argument("why", nargs="?", default=""); s.add_argument("--figures", default="{}")
    s = sub.add_parser("env"); s.add_argument("--expect-cuda", action="store_true")
    s.add_argument("--note", default="")
    s.add_argument("--site", help="where the carried wheels were installed")
    s = sub.add_parser("meta", help="merge key=value pairs into the JSON's meta"); s.add_argument("pairs", nargs="*")
    s = sub.add_parser("ds-json"); s.add_argument("src", type=Path); s.add_argument("dst", type=Path)
    s.add_argument("--precision", choices=("fp16", "bf16", "fp32"), required=True)
    s.add_argument("--initial-scale-power", type=int); s.add_argument("--loss-scale-window", type=int)
    sub.add_parser("validate-ds", help="[--cuda] JSON... -- TRAINER ARGS: resolve each DeepSpeed JSON as "
                   "train/training/build.py does (--cuda: as on a GPU); prints {name: {precision, backend, stage}}")
    s = sub.add_parser("tokens"); s.add_argument("out", type=Path); s.add_argument("--vocab", type=int, default=50304)
    s.add_argument("--n", type=int, default=4_000_000); s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("synth-fp16"); s.add_argument("run_dir", type=Path)
    s.add_argument("--constant-scale", action="store_true")
    s = sub.add_parser("summary"); s.add_argument("out", type=Path)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["validate-ds"]:  # JSON paths and trainer options: parsed here, not by argparse
        items = argv[1:]
        cut = items.index("--") if "--" in items else len(items)
        paths, args = [x for x in items[:cut] if x != "--cuda"], items[cut + 1:]
        print(json.dumps({Path(x).stem: validate_ds(Path(x), args, "--cuda" in items[:cut]) for x in paths}))
        return 0
    a = p.parse_args(argv)

    if a.cmd == "fp16":
        return check_fp16(a.name, a.run_dir, a.min_drop, a.note, json.loads(a.extra))
    if a.cmd == "run":
        return check_run(a.name, a.run_dir, a.min_drop, a.note, json.loads(a.extra))
    if a.cmd == "agree":
        runs = dict(r.split("=", 1) for r in a.runs)
        return check_agree(a.name, {k: Path(v) for k, v in runs.items()}, a.rtol, a.note)
    if a.cmd == "mfu":
        return check_mfu(a.name, a.run_dir, a.target, a.skip_windows, a.model, json.loads(a.overrides), a.seq_len,
                         a.note)
    if a.cmd == "mfu-independent":
        return check_mfu_independent(a.name, a.result, a.mode, a.target, a.trainer_check, a.note)
    if a.cmd == "stage":
        return check_stage(a.name, a.stages_dir, a.min_ratio, a.note)
    if a.cmd == "plan":
        return check_plan(a.name, a.stages_dir, a.note)
    if a.cmd == "ckpt-async":
        return check_ckpt_async(a.name, a.async_run, a.resume_run, a.sync_run, [int(x) for x in a.steps.split(",")],
                                a.resume_from, a.require_faster, a.strict_sync, a.note)
    if a.cmd == "failed":
        return failed(a.name, a.rc, a.limit, a.log)
    if a.cmd == "record":
        return record(a.name, a.result == "pass", a.why, json.loads(a.figures))
    if a.cmd == "env":
        return env_check(a.expect_cuda, a.note, a.site)
    if a.cmd == "meta":
        pairs = dict(kv.split("=", 1) for kv in a.pairs)
        _update(lambda doc: doc["meta"].update(pairs))
        return 0
    if a.cmd == "ds-json":
        ds_json(a.src, a.dst, a.precision, a.initial_scale_power, a.loss_scale_window)
        return 0
    if a.cmd == "tokens":
        print(json.dumps(write_tokens(a.out, a.vocab, a.n, a.seed)))
        return 0
    if a.cmd == "synth-fp16":
        synth_fp16(a.run_dir, a.constant_scale)
        return 0
    if a.cmd == "summary":
        print(summary(a.out), end="")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
