"""checkpoint.async against synchronous saves: what the training loop is blocked for, per save.

Per model size, launches of train/main.py (2 processes, the deepspeed launcher, ZeRO-2 or -3 in
fp32 on CPU) alternating sync / async (`--pairs` pairs: the machine may be shared, so both sides
see the same load), each training `--steps` steps with `checkpoint.every_steps --save-every` and
no save at the end (every save measured is a periodic one, with training going on after it).
From each run's metrics.jsonl (logging.every_steps 1):

- blocked: `checkpoint/save_s`, the loop's wall time inside the save on rank 0 (sync: the whole
  write + fsync + sha256 + commit; async: waiting for a previous write, agreeing on the
  directory, copying the rank's state into the host snapshot);
- write: async only, `checkpoint/write_s`, the background thread's write (files, fsync, sha256);
  `checkpoint/wait_s`, what a save or the end of the run waited for a write still running;
- steps: `step_time_s` of the step right after each save (sync: a step like any other; async:
  it runs while the write does) against the steps with no save (after `--warmup`) and, for async,
  none in flight (from a save's step to the step its commit is logged at);
- memory: `checkpoint/snapshot_bytes` (rank 0's host snapshot, reused by every save) and the
  run's peak RSS (`peak_mem_bytes` on CPU: the max over ranks of ru_maxrss), async against sync.

Also the copy rate the snapshot should approach: a torch `copy_` of a rank-sized fp32 tensor into
a preallocated one, one thread (as each rank runs: OMP_NUM_THREADS = cores / processes), median
of `--memcpy-reps`. Copy rate of a save = snapshot bytes / blocked time.

Writes <out>/async_save-<timestamp>.json and .md (and prints the table).

    python bench/async_save.py                                   # 3 sizes, ZeRO-2, 2 pairs each
    python bench/async_save.py --sizes default --pairs 1 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

# name -> extra args on top of examples/default.yaml (gpt-small-cpu: vocab 256, seq_len 128)
SIZES = {
    "default": [],                                                      # 0.8M params
    "gpt-11m": ["--model.d_model", "384", "--model.n_layer", "6", "--train.micro_batch_size", "4"],
    "gpt-78m": ["--model.d_model", "768", "--model.n_layer", "12", "--train.micro_batch_size", "2"],
}
CPU_ONLY = {"ZEROTRAIN_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}


def parse(argv):
    p = argparse.ArgumentParser(description="checkpoint.async benchmark (BENCHMARKS.md)")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated: {', '.join(SIZES)}")
    p.add_argument("--stage", default="zero2", help="ds_configs/<name>.json, run in fp32")
    p.add_argument("--pairs", type=int, default=2, help="sync/async launch pairs per size (alternating)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step times")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--memcpy-reps", type=int, default=7)
    p.add_argument("--work", default=None, help="where the run directories go (default: a temp dir on /tmp's disk)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--keep", action="store_true", help="keep each launch's checkpoints (default: removed once read)")
    a = p.parse_args(argv)
    bad = [s for s in a.sizes.split(",") if s not in SIZES]
    if bad:
        p.error(f"unknown size(s) {bad}; known: {', '.join(SIZES)}")
    return a


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(a, args: list[str], log: Path) -> None:
    """One deepspeed-launcher run of train/main.py."""
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore", **CPU_ONLY,
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // a.nproc))))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(a.nproc), "--master_port",
           str(free_port()), str(REPO / "train" / "main.py"), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=a.timeout)
    log.write_text("$ " + shlex.join(cmd) + "\n" + proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed (exit {proc.returncode}); log {log}:\n{proc.stdout[-3000:]}")


def fp32_json(stage: str, d: Path) -> Path:
    data = json.loads((REPO / "ds_configs" / f"{stage}.json").read_text())
    data["bf16"], data["fp16"] = {"enabled": False}, {"enabled": False}
    out = d / f"{stage}_fp32.json"
    out.write_text(json.dumps(data, indent=1))
    return out


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_one(a, size: str, mode: str, i: int, work: Path) -> dict:
    d = work / f"{size}-{mode}-{i}"
    d.mkdir(parents=True, exist_ok=True)
    run = d / "run"
    load0 = os.getloadavg()[0]
    launch(a, ["--config", str(REPO / "examples" / "default.yaml"), *SIZES[size],
               "--ds-config", str(fp32_json(a.stage, d)), "--train.run_dir", str(run),
               "--train.max_steps", str(a.steps), "--train.eval_every", "0", "--train.sample_tokens", "0",
               "--logging.progress", "false", "--logging.every_steps", "1",
               "--checkpoint.every_steps", str(a.save_every), "--checkpoint.save_at_end", "false",
               "--checkpoint.export", "false", "--checkpoint.keep_last", "2", "--optim.warmup_steps", "2",
               "--checkpoint.async", "true" if mode == "async" else "false"], d / "train.log")
    rs = rows(run)
    if not a.keep:  # gpt-78m's checkpoints are ~1.8 GB a launch
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    step_t = {r["step"]: r["step_time_s"] for r in rs if "step_time_s" in r}
    saves = [r for r in rs if "checkpoint/save_s" in r]
    # the checkpoint's step (async logs it at the commit step, sync at its own step) and the
    # steps its write was in flight: after the save, up to the commit
    out_saves, busy = [], set()
    for r in saves:
        at = int(r.get("checkpoint/step", r["step"]))
        done = int(r["step"])
        busy.update(range(at + 1, done + 1))
        out_saves.append({"step": at, "committed_at": done, "blocked_s": r["checkpoint/save_s"],
                          "write_s": r.get("checkpoint/write_s"), "wait_s": r.get("checkpoint/wait_s"),
                          "bytes": r["checkpoint/bytes"], "snapshot_bytes": r.get("checkpoint/snapshot_bytes"),
                          "next_step_s": step_t.get(at + 1)})
    save_steps = {s["step"] for s in out_saves}
    quiet = [t for s, t in step_t.items() if s > a.warmup and s not in busy and s - 1 not in save_steps]
    after = [s["next_step_s"] for s in out_saves if s["next_step_s"] is not None]
    res = {"size": size, "mode": mode, "pair": i, "saves": out_saves,
           "blocked_s": [s["blocked_s"] for s in out_saves],
           "write_s": [s["write_s"] for s in out_saves if s["write_s"] is not None],
           "wait_s": [s["wait_s"] for s in out_saves if s["wait_s"] is not None],
           "step_after_save_s": after, "step_quiet_s": quiet,
           "bytes": out_saves[-1]["bytes"], "snapshot_bytes": out_saves[-1]["snapshot_bytes"] or 0,
           "peak_rss_bytes": max(r["peak_mem_bytes"] for r in rs if "peak_mem_bytes" in r),
           "load_avg_1min": [load0, os.getloadavg()[0]]}
    print(f"  {size} {mode} #{i}: blocked {[round(x, 3) for x in res['blocked_s']]} s, write "
          f"{[round(x, 3) for x in res['write_s']]} s, step after save {[round(x, 3) for x in after]} s, quiet "
          f"{statistics.median(quiet):.3f} s, peak RSS {res['peak_rss_bytes'] / 2**20:.0f} MiB, "
          f"load {res['load_avg_1min']}", flush=True)
    return res


def memcpy_rate(nbytes: int, reps: int) -> dict:
    """GB/s of copy_ between two preallocated fp32 tensors of nbytes, one thread (as a rank runs)."""
    import torch
    torch.set_num_threads(1)
    n = max(1, nbytes // 4)
    src, dst = torch.randn(n), torch.empty(n)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    return {"bytes": n * 4, "median_s": med, "gb_per_s": n * 4 / med / 1e9, "times_s": times}


def summary(results: list[dict], size: str, mode: str) -> dict:
    rs = [r for r in results if r["size"] == size and r["mode"] == mode]
    flat = lambda k: [x for r in rs for x in r[k]]  # noqa: E731
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {"blocked_s": med(flat("blocked_s")), "n_saves": len(flat("blocked_s")), "write_s": med(flat("write_s")),
            "wait_s": med(flat("wait_s")), "step_after_save_s": med(flat("step_after_save_s")),
            "step_quiet_s": med(flat("step_quiet_s")), "bytes": rs[-1]["bytes"],
            "snapshot_bytes": rs[-1]["snapshot_bytes"], "peak_rss_bytes": med([r["peak_rss_bytes"] for r in rs]),
            "load": [x for r in rs for x in r["load_avg_1min"]]}


def markdown(results: list[dict], sizes: list[str], mem: dict, meta: dict) -> str:
    f = lambda x, p=2: "–" if x is None else f"{x:.{p}f}"  # noqa: E731
    lines = [f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: {meta['machine']}", "",
             "memcpy (torch copy_ between preallocated fp32 tensors of the size's snapshot, 1 thread, median): "
             + ", ".join(f"{s} {m['bytes'] / 2**20:.1f} MiB {m['gb_per_s']:.2f} GB/s" for s, m in mem.items()), "",
             "| model | checkpoint | mode | blocked per save, s (median) | saves | background write, s | "
             "step after a save, s | step, no save, s | snapshot (rank 0) | copy rate = snapshot / blocked | "
             "peak RSS (max rank) | load avg |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        for mode in ("sync", "async"):
            s = summary(results, size, mode)
            snap = s["snapshot_bytes"]
            rate = (f"{snap / s['blocked_s'] / 1e9:.2f} GB/s ({100 * snap / s['blocked_s'] / 1e9 / mem[size]['gb_per_s']:.0f} "
                    f"% of memcpy)") if mode == "async" and snap and s["blocked_s"] else "–"
            lines.append(f"| {size} | {s['bytes'] / 2**20:.1f} MiB | {mode} | {f(s['blocked_s'], 3)} | {s['n_saves']} | "
                         f"{f(s['write_s'], 3)} | {f(s['step_after_save_s'], 3)} | {f(s['step_quiet_s'], 3)} | "
                         f"{snap / 2**20:.1f} MiB | {rate} | {s['peak_rss_bytes'] / 2**20:.0f} MiB | "
                         f"{min(s['load']):.1f}–{max(s['load']):.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    from stages import machine
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="zt-async-", dir="/tmp"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    meta = {"command": f"python bench/async_save.py {shlex.join(argv if argv is not None else sys.argv[1:])}".strip(),
            "date": time.strftime("%Y-%m-%d"), "machine": machine(), "work_dir": str(work), "stage": a.stage,
            "nproc": a.nproc, "launcher": "deepspeed", "steps": a.steps, "save_every": a.save_every,
            "filesystem": subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.strip()}
    print(f"run directories under {work}", flush=True)
    sizes = a.sizes.split(",")
    results = []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    partial = out / f"async_save-{stamp}.partial.json"
    for size in sizes:
        for i in range(a.pairs):
            for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):  # ABBA: neither side always first
                results.append(run_one(a, size, mode, i, work))
                partial.write_text(json.dumps({"meta": meta, "runs": results}, indent=1) + "\n")  # kept if cut short
    # at each size's snapshot, so that a small one's copy out of the cache shows as such
    mem = {s: memcpy_rate(max(r["snapshot_bytes"] for r in results if r["size"] == s) or 2**20, a.memcpy_reps)
           for s in sizes}
    partial.unlink()
    summ = {s: {m: summary(results, s, m) for m in ("sync", "async")} for s in sizes}
    (out / f"async_save-{stamp}.json").write_text(json.dumps(
        {"meta": meta, "memcpy": mem, "summary": summ, "runs": results}, indent=1) + "\n")
    md = markdown(results, sizes, mem, {**meta, "machine": f"{meta['machine'].get('cpu')}, "
                                        f"{meta['machine'].get('cpu_cores')} cores, no GPU"})
    (out / f"async_save-{stamp}.md").write_text(md)
    print(md)
    print(f"written: {out / f'async_save-{stamp}.json'}, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
