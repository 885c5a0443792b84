"""The fit frontier: which ZeRO options fit a per-rank memory limit, as the planner predicts
it and as the kernel decides it.

For one GPT and one cap, every option of train/plan.OPTIONS (the shipped JSONs, fp32 on a CPU)
is trained three times on N processes (torchrun), each rank in a memory cgroup of its own
(bench/memcap.py): without a limit, to measure its peak as the kernel counts it against one
(the cgroup's peak usage; bench/rank_peak.py's max RSS is recorded too, and includes ~0.5 GiB of
shared library code no cgroup is charged for); under the cap with zerotrain's defaults (its
memory check refuses what would not fit, and turns compact malloc on where only that makes a
run fit: train/launch/host_settings.py); and under the cap with the memory check switched off,
to see whether the kernel lets it finish or kills it. The planner's peak comes from each run's
config.json (the figure zerotrain's check compares with the budget). Last, --ds-config auto
under the cap says what zerotrain itself would choose.

    python bench/frontier.py                                 # the BENCHMARKS.md table (~20 min)
    python bench/frontier.py --d-model 1024 --n-layer 16 --cap 3GiB --options ddp,zero3

Writes bench/results/frontier-<timestamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memcap  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from zerotrain.train.strategy import ddp, fsdp2, zero  # noqa: E402
from stages import BIN, REPO, free_port, machine, peaks  # noqa: E402

OPTIONS = ("ddp", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")
GiB = 2 ** 30


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--cap", default="3GiB", help="memory limit per rank")
    p.add_argument("--options", default=",".join(OPTIONS))
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "json"))
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    return p.parse_args(argv)


def family(precision: str, d: Path) -> Path:
    """The shipped JSONs under their own names (what `auto:<dir>` chooses among), in `precision`."""
    d.mkdir(parents=True, exist_ok=True)
    for p in (REPO / "ds_configs").glob("*.json"):
        data = json.loads(p.read_text())
        if precision != "json" and "bf16" in data:
            data["bf16"] = {"enabled": precision == "bf16"}
        (d / p.name).write_text(json.dumps(data, indent=1))
    return d


def trainer_args(a) -> list[str]:
    return ["--model.name", "gpt-small-cpu", "--model.d_model", str(a.d_model), "--model.n_layer", str(a.n_layer),
            "--data.seq_len", str(a.seq_len), "--data.max_bytes", "300000", "--train.micro_batch_size",
            str(a.micro_batch), "--train.max_steps", str(a.steps), "--train.eval_every", "0",
            "--train.eval_batches", "1", "--train.sample_tokens", "0", "--logging.progress", "false",
            "--logging.every_steps", "1", "--checkpoint.save_at_end", "false", "--checkpoint.export", "false"]


def launch(a, args: list[str], run: Path, cap: int | None, report: bool = True, env_extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    env.update(ZT_PEAK_DIR=str(run / "peak"), PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // a.nproc))))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(env_extra or {})
    # Every run in a memory cgroup of its own (no cap: as much as the machine has): its peak usage
    # is what the kernel holds against a limit, the planner's quantity on a CPU.
    limit = cap or (machine().get("ram_bytes") or 1 << 40)
    wrap = [str(REPO / "bench" / "memcap.py"), "--limit", f"{limit}B", "--report-dir", str(run / "cgroup"), "--"] \
        if report else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_port",
           str(free_port()), *wrap, str(REPO / "bench" / "rank_peak.py"), str(REPO / "train" / "main.py"),
           *args, "--train.run_dir", str(run / "run")]
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(run / "log", "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout).returncode
    log = (run / "log").read_text()
    cgroups = [json.loads(f.read_text()) for f in sorted((run / "cgroup").glob("rank*.json"))] \
        if (run / "cgroup").is_dir() else []
    out = {"rc": rc, "seconds": time.perf_counter() - t0, "killed": "memcap: the kernel killed" in log,
           "refused": "(distributed.memory_check false skips this check)" in log,
           "peak_bytes_per_rank": [c["peak_usage_bytes"] for c in cgroups] or
           (peaks(run / "peak") if (run / "peak").is_dir() else []),
           "max_rss_bytes_per_rank": peaks(run / "peak") if (run / "peak").is_dir() else []}
    cfg = run / "run" / "config.json"
    if cfg.is_file():
        resolved = json.loads(cfg.read_text())["resolved"]
        plan = resolved.get("memory_plan") or {}
        out["planned_peak_bytes"] = (plan.get("device_bytes") or {}).get("total")
        out["budget"] = resolved.get("memory_budget")
        out["auto"] = resolved.get("auto_ds_config")
        out["host_malloc"] = (resolved.get("host_settings") or {}).get("malloc")
    return out


def outcome(run: dict) -> str:
    if run["rc"] == 0:
        return "trained" + (f" ({run['host_malloc']} malloc)" if run.get("host_malloc") else "")
    if run["killed"]:
        return "killed by the kernel (exit 137)"
    if run.get("refused"):
        return "refused by the memory check before building the model (exit 2)"
    return f"failed (exit {run['rc']})"


def _glibc_growth(option: str) -> float:
    """The glibc growth (Strategy.malloc_figures) of a shipped option: DDP's, FSDP2's or its ZeRO stage's."""
    if option.startswith("fsdp2"):
        return fsdp2.GLIBC_GROWTH
    return ddp.GLIBC_GROWTH if option == "ddp" else zero.GLIBC_GROWTH[int(option[4])]


def markdown(rows: list[dict], auto: dict, meta: dict) -> str:
    cap = meta["cap_bytes"]
    lines = [f"Command: `{meta['command']}`  ",
             f"Machine: {meta['machine'].get('cpu')} ({meta['machine'].get('cpu_cores')} cores, "
             f"{meta['machine'].get('ram_bytes', 0) / GiB:.0f} GiB), torch {meta['machine'].get('torch')}, deepspeed "
             f"{meta['machine'].get('deepspeed')}  ",
             f"Model: {meta['model']}; {meta['nproc']} processes; cap {cap / GiB:.2f} GiB per rank (memory cgroup)", "",
             "| option | predicted peak GiB (live tensors) | no cap: malloc, predicted for it GiB | measured peak GiB "
             "(no cap) | planner error | predicted under the cap | under the cap, defaults (memory check on) "
             "| under the cap, memory check off |", "|---|---:|---|---:|---:|---|---|---|"]
    for r in rows:
        pred, meas = r["free"].get("planned_peak_bytes"), max(r["free"]["peak_bytes_per_rank"] or [0])
        malloc = r["free"].get("host_malloc") or "?"
        # glibc keeps freed blocks: the memory check's host settings scale the plan by its growth.
        expect = pred * (_glibc_growth(r["config"]) if malloc == "glibc" else 1.0) if pred else None
        err = f"{(expect - meas) / meas:+.1%}" if expect and meas else "-"
        checked, capped = outcome(r["checked"]), outcome(r["capped"])
        lines.append(f"| {r['label']} | {pred / GiB:.3f} | {malloc}, {expect / GiB:.3f} | {meas / GiB:.3f} | {err} | "
                     f"{'fits' if pred and pred <= cap else 'does not fit'} | {checked} | {capped} |" if pred else
                     f"| {r['label']} | - | {malloc} | {meas / GiB:.3f} | - | - | {checked} | {capped} |")
    if auto:
        a = auto.get("auto") or {}
        lines += ["", f"`--ds-config auto` under the cap: **{a.get('option')}** ({a.get('ds_config')}), predicted "
                      f"{(a.get('predicted_peak_bytes') or 0) / GiB:.3f} GiB with {a.get('margin', 0):.0%} headroom "
                      f"(next faster: {(a.get('next_faster') or {}).get('option')}, "
                      f"{((a.get('next_faster') or {}).get('predicted_peak_bytes') or 0) / GiB:.3f} GiB); "
                      f"the run {'trained' if auto['rc'] == 0 else 'failed'}, measured peak "
                      f"{max(auto['peak_bytes_per_rank'] or [0]) / GiB:.3f} GiB."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    why = memcap.can_cap()
    if why is not None:
        sys.exit(f"frontier.py: cannot set a memory limit here ({why}); run as root on Linux with a memory cgroup")
    cap = memcap.parse_size(a.cap)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(a.out)
    tmp = out_dir / f"tmp-frontier-{stamp}"
    fam = family(a.precision, tmp / "configs")
    labels = {"ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
              "zero2_offload": "ZeRO-2 + opt offload", "zero3_offload": "ZeRO-3 + param/opt offload",
              "fsdp2": "FSDP2", "fsdp2_keep": "FSDP2, kept after forward"}
    base = trainer_args(a)
    rows = []
    for name in [n.strip() for n in a.options.split(",") if n.strip()]:
        print(f"[frontier] {name}: no cap ...", flush=True)
        free = launch(a, [*base, "--ds-config", str(fam / f"{name}.json")], tmp / name / "free", None)
        print(f"[frontier] {name}: under {a.cap}, defaults (memory check on) ...", flush=True)
        checked = launch(a, [*base, "--ds-config", str(fam / f"{name}.json")], tmp / name / "checked", cap)
        print(f"[frontier] {name}: under {a.cap}, memory check off ...", flush=True)
        capped = launch(a, [*base, "--ds-config", str(fam / f"{name}.json"), "--distributed.memory_check", "false"],
                        tmp / name / "capped", cap)
        rows.append({"config": name, "label": labels.get(name, name), "free": free, "checked": checked,
                     "capped": capped})
        print(f"[frontier] {name}: predicted {(free.get('planned_peak_bytes') or 0) / GiB:.3f} GiB, measured "
              f"{max(free['peak_bytes_per_rank'] or [0]) / GiB:.3f} GiB; under the cap: exit {capped['rc']}", flush=True)
    print("[frontier] --ds-config auto under the cap ...", flush=True)
    auto = launch(a, [*base, "--ds-config", f"auto:{fam}"], tmp / "auto", cap)
    meta = {"command": shlex.join([Path(sys.executable).name, "bench/frontier.py", *(sys.argv[1:] if argv is None
                                                                                       else argv)]),
            "machine": machine(), "model": f"gpt-small-cpu d_model={a.d_model} n_layer={a.n_layer} seq={a.seq_len} "
            f"micro={a.micro_batch}, {a.precision}", "nproc": a.nproc, "cap_bytes": cap,
            "started": stamp, "finished": time.strftime("%Y%m%d-%H%M%S")}
    (out_dir / f"frontier-{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows, "auto": auto},
                                                               indent=1) + "\n")
    md = markdown(rows, auto, meta)
    (out_dir / f"frontier-{stamp}.md").write_text(md)
    print(md)
    print(f"[frontier] wrote {out_dir / f'frontier-{stamp}.json'} and .md (logs in {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
