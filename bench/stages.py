"""Stage benchmark: train one GPT for a fixed number of steps under each ds_configs/*.json on
N processes (the deepspeed launcher), alternately with zerotrain (train/main.py, its defaults)
and with bench/plain_loop.py (the independent baseline: the same model file and data bytes,
nothing else of zerotrain, a clean environment) — and report per stage:

* tokens/s: the median over timed windows after the warm-up steps (trainer and plain loop;
  both wall clock: the plain loop's own clock every --window steps, the trainer's between its
  metrics.jsonl log rows, written every --window steps, so log work counts as it would for a user);
* the plain loop in two arms per pair (--plain-threads): torch's default threads (every core
  per process: 2 ranks on 2 cores oversubscribe them) and OMP_NUM_THREADS=1 (1 thread per
  rank); the "best plain loop" of a pair is its faster arm;
* trainer/best plain loop per alternated pair (plain arms, then the trainer, per repeat): the
  median of the pairs' ratios and their spread; also against each arm alone;
* optionally the trainer with settings changed (--variant), each alternated with the baseline too;
* peak memory per rank (CUDA max allocated on GPU, max RSS on CPU; bench/rank_peak.py);
* model-state bytes per rank measured in the running engine (train/observe/memory.py, mem/*) and the
  planner's estimate for the same rank (train/plan/estimate.py, plan/*).

Writes <out>/stages-<timestamp>.json and .md (and prints the table).

    python bench/stages.py                      # every ds_configs/*.json, 2 processes
    python bench/stages.py --configs zero2,zero3 --d-model 512 --n-layer 8
    python bench/stages.py --quick              # a smoke run (tests/test_bench.py)
    python bench/stages.py --issue41            # issue 41's measurement: ddp,zero1,zero2,zero3, 3 pairs
    python bench/stages.py --configs zero2 --variant 'compact||--hardware.host_malloc compact' \
        --variant 'thp|THP_MEM_ALLOC_ENABLE=1|'  # the trainer with a setting changed: NAME|ENV=V ...|FLAGS

The JSON keeps the best plain loop of each pair under the key "minimal" (bench/gpu_checks.py
reads it: "minimal", "minimal_tokens_per_s", "throughput_ratio"), each arm under "plain_<arm>"
("plain_default", "plain_1thread").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ORDER = ("ddp", "zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload")


def parse(argv):
    p = argparse.ArgumentParser(description="zerotrain stage benchmark (see BENCHMARKS.md)")
    p.add_argument("--model", default="gpt-small-cpu", help="GPT preset")
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=45, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the timing")
    p.add_argument("--window", type=int, default=5, help="steps per timed window")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--configs", default=",".join(ORDER), help="comma-separated ds_configs/*.json names")
    p.add_argument("--precision", default="auto", choices=("auto", "json", "fp32", "bf16"),
                   help="auto: fp32 on CPU (bf16 matmuls are ~80x slower there), the JSON's own on GPU")
    p.add_argument("--repeats", type=int, default=3, help="trainer/plain pairs per config (alternated)")
    p.add_argument("--plain-threads", default="default,1", metavar="ARMS",
                   help="the plain loop's arms per pair, comma-separated: 'default' (torch's own thread count) "
                        "and/or a number N (OMP_NUM_THREADS=N); the best plain loop is the pair's fastest arm")
    p.add_argument("--issue41", action="store_true",
                   help="issue 41's measurement: d_model 256, n_layer 4, seq 256, micro 8, 2 processes, fp32, the "
                        "deepspeed launcher, 45 steps: 40 timed after 5 warm-up in 5-step windows (these override "
                        "their flags); ddp,zero1,zero2,zero3 unless --configs; --repeats pairs (default 3)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME|ENV=V ...|FLAGS",
                   help="also run the trainer with these environment variables and flags (repeatable)")
    p.add_argument("--launcher", default="deepspeed", choices=("deepspeed", "torchrun"))
    p.add_argument("--max-bytes", type=int, default=2_000_000, help="corpus bytes (data.max_bytes)")
    p.add_argument("--timeout", type=int, default=1200, help="seconds per launch")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, zero2 only (smoke test)")
    a = p.parse_args(argv)
    if a.issue41 and a.quick:
        p.error("--issue41 and --quick are two different presets: pick one")
    if a.issue41:
        a.model, a.d_model, a.n_layer, a.seq_len, a.micro_batch, a.grad_accum = "gpt-small-cpu", 256, 4, 256, 8, 1
        a.nproc, a.precision, a.launcher = 2, "fp32", "deepspeed"
        a.steps, a.warmup, a.window = 45, 5, 5
        if a.configs == ",".join(ORDER):
            a.configs = "ddp,zero1,zero2,zero3"
    if a.quick:
        a.model, a.d_model, a.n_layer, a.seq_len, a.micro_batch = "gpt-tiny", 64, 2, 32, 4
        a.steps, a.warmup, a.window, a.max_bytes = 6, 2, 2, 200_000
        a.repeats = 1
        if a.configs == ",".join(ORDER):
            a.configs = "zero2"
    if a.steps < a.warmup + a.window or a.warmup < 2:
        p.error("need --warmup >= 2 (the memory probe runs on step 2) and --steps >= --warmup + --window")
    if a.warmup % a.window:
        p.error(f"--warmup {a.warmup} must be a multiple of --window {a.window} (the trainer's log rows "
                "bound its timed windows: the first timed one starts at the warm-up's last step)")
    try:
        a.arms = plain_arms(a.plain_threads)
    except ValueError as e:
        p.error(f"--plain-threads {a.plain_threads!r}: {e}")
    return a


def plain_arms(text: str) -> list[tuple[str, dict]]:
    """'default,1' -> [("default", {}), ("1thread", {"OMP_NUM_THREADS": "1"})]."""
    arms = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "default":
            arms.append(("default", {}))
        elif item.isdigit() and int(item) > 0:
            arms.append((f"{int(item)}thread", {"OMP_NUM_THREADS": str(int(item))}))
        else:
            raise ValueError(f"{item!r} is neither 'default' nor a thread count (e.g. default,1)")
    if not arms or len({n for n, _ in arms}) != len(arms):
        raise ValueError("want one or more distinct arms, e.g. default,1")
    return arms


def machine() -> dict:
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    mem = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), None) if Path("/proc/meminfo").exists() else None
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "ram_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform()}
    try:
        import deepspeed
        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def config_for(name: str, precision: str, cuda: bool, tmp: Path) -> Path:
    """ds_configs/<name>.json, with bf16/fp16 switched off for an fp32 run."""
    data = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
    if precision == "fp32" or (precision == "auto" and not cuda):
        data["bf16"], data["fp16"] = {"enabled": False}, {"enabled": False}
    elif precision == "bf16":
        data["bf16"], data["fp16"] = {"enabled": True}, {"enabled": False}
    out = tmp / f"{name}.json"
    out.write_text(json.dumps(data, indent=1))
    return out


def trainer_args(a) -> list[str]:
    return ["--model.name", a.model, "--model.d_model", str(a.d_model), "--model.n_layer", str(a.n_layer),
            "--model.seq_len", str(a.seq_len), "--data.seq_len", str(a.seq_len),  # the plain loop's context too
            "--train.micro_batch_size", str(a.micro_batch), "--train.grad_accum_steps", str(a.grad_accum),
            "--train.max_steps", str(a.steps), "--logging.every_steps", str(a.window),
            "--train.eval_every", "0", "--train.eval_batches", "1", "--train.sample_tokens", "0",
            "--logging.progress", "false", "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
            "--optim.warmup_steps", "2"]


# Settings that change how the process allocates or where it runs: none reaches the baseline
# but a plain-loop arm's own (--plain-threads), and the trainer gets them only through
# --variant (what its defaults do is the point).
HOST_VARS = ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX",
             "LD_PRELOAD", "ZEROTRAIN_DEVICE", "WANDB_MODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
             "MASTER_PORT")


def clean_env(a, peak_dir: Path, extra: dict | None = None) -> dict:
    """This shell's environment without any host setting, plus what the harness needs: the
    venv first on PATH (its ninja: a different one discards DeepSpeed's JIT build log and
    rebuilds), DeepSpeed's JIT cache, the peak-memory output; `extra` (a --variant's) last."""
    env = {k: v for k, v in os.environ.items() if k not in HOST_VARS and not k.startswith("ZEROTRAIN_")}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    env.update(ZT_PEAK_DIR=str(peak_dir), PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra or {})
    return env


def launch(a, script: str, args: list[str], peak_dir: Path, log: Path, extra_env: dict | None = None) -> float:
    env = clean_env(a, peak_dir, extra_env)
    port = str(free_port())
    if a.launcher == "deepspeed":  # as `make train` (it sets LOCAL_SIZE: DeepSpeed's shm all-reduce on CPU)
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(a.nproc), "--master_port", port]
    else:  # `python -m torch.distributed.run` = torchrun, also where pip put no torchrun next to python
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_port", port]
    cmd += [str(REPO / "bench" / "rank_peak.py"), script, *args]
    t0 = time.perf_counter()
    try:
        with open(log, "w") as f:
            f.write("$ " + shlex.join(cmd) + "\n")
            f.flush()
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=a.timeout).returncode
    finally:
        _sweep_shm()  # the plain loop leaves DeepSpeed's /dev/shm buffers behind (train/launch/shm_buffers.py)
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"{script} failed (exit {rc}); log {log}:\n{tail}")
    return time.perf_counter() - t0


def _sweep_shm():
    sys.path.insert(0, str(REPO))
    from zerotrain.train.launch import shm_buffers
    shm_buffers.sweep_stale(min_age_s=0.0)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peaks(peak_dir: Path) -> list[int]:
    files = sorted(peak_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text())["peak_bytes"] for p in files]


def tokens_per_cpu_s(peak_dir: Path, windows: list[tuple[float, float, float]]) -> list[float]:
    """Tokens per CPU second of rank 0 for each (wall start, wall end, tokens) window, from
    the (wall, CPU) trace bench/rank_peak.py sampled every 50 ms."""
    trace = json.loads((peak_dir / "rank0.json").read_text())["cpu_trace"]

    def cpu_at(t):
        for (w0, c0), (w1, c1) in zip(trace, trace[1:]):
            if w0 <= t <= w1:
                return c0 + (c1 - c0) * (t - w0) / max(w1 - w0, 1e-9)
        raise ValueError(f"time {t} is outside the CPU trace")
    return [tokens / (cpu_at(end) - cpu_at(start)) for start, end, tokens in windows]


def parse_variant(text: str) -> tuple[str, dict, list[str]]:
    """'NAME|ENV=V ENV2=V|--flag value ...' -> (name, env, flags)."""
    parts = text.split("|")
    if len(parts) != 3 or not parts[0].strip():
        sys.exit(f"stages.py: --variant {text!r}: want NAME|ENV=V ...|FLAGS (either part may be empty)")
    env = dict(kv.split("=", 1) for kv in shlex.split(parts[1]))
    return parts[0].strip(), env, shlex.split(parts[2])


def plain_args(a, ds: Path, data: Path, out: Path) -> list[str]:
    """bench/plain_loop.py's flags for the same run: the stage read from the JSON, nothing else."""
    js = json.loads(ds.read_text())
    zero = js.get("zero_optimization", {})
    stage = "ddp" if "ddp" in js or "zero_optimization" not in js else str(zero.get("stage", 0))
    if "fsdp" in js:
        stage = "fsdp2" if js["fsdp"].get("reshard_after_forward", True) else "fsdp2_keep"
    offload = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    return ["--stage", stage, *(["--offload"] if offload else []), "--data", str(data), "--model", a.model,
            "--d-model", str(a.d_model), "--n-layer", str(a.n_layer), "--seq-len", str(a.seq_len),
            "--micro-batch", str(a.micro_batch), "--grad-accum", str(a.grad_accum), "--steps", str(a.steps),
            "--window", str(a.window), "--out", str(out)]


def corpus(a, tmp: Path) -> Path:
    """The bytes both loops train on: this Python's standard library sources (the trainer's
    default corpus), the first --max-bytes of them, written once to a file."""
    out = tmp / "corpus.txt"
    if not out.is_file():
        import sysconfig
        chunks, n = [], 0
        for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
            b = f.read_bytes()
            chunks.append(b)
            n += len(b)
            if n >= a.max_bytes:
                break
        out.write_bytes(b"".join(chunks)[:a.max_bytes])
    return out


def run_config(a, name: str, tmp: Path, cuda: bool) -> dict:
    ds = config_for(name, a.precision, cuda, tmp)
    data = corpus(a, tmp)
    variants = [("defaults", {}, [])] + [parse_variant(v) for v in a.variant]
    res = {"config": name, "ds_config": f"ds_configs/{name}.json", "trainer": [], "minimal": [],
           "plain_arms": [arm for arm, _ in a.arms], **{f"plain_{arm}": [] for arm, _ in a.arms},
           "variants": {v[0]: [] for v in variants[1:]}}
    first = a.warmup // a.window   # windows that end after the warm-up
    for rep in range(a.repeats):
        run = tmp / f"{name}-{rep}"
        run.mkdir(parents=True, exist_ok=True)
        load0 = os.getloadavg()[0]
        arms = []
        for arm, env in a.arms:
            out, peak_dir = run / f"plain-{arm}.json", run / f"peak-plain-{arm}"
            launch(a, str(REPO / "bench" / "plain_loop.py"), plain_args(a, ds, data, out), peak_dir,
                   run / f"plain-{arm}.log", env)
            m = json.loads(out.read_text())
            b = m["window_bounds"]
            cpu_windows = [(b[i], b[i + 1], m["window_steps"] * m["tokens_per_step"])
                           for i in range(first, len(b) - 1)]
            timed = m["window_s"][first:]
            r = {"arm": arm, "torch_threads": m.get("torch_threads"), "omp_num_threads": m.get("omp_num_threads"),
                 "window_tokens_per_s": m["window_tokens_per_s"][first:],
                 "span_tokens_per_s": len(timed) * m["window_steps"] * m["tokens_per_step"] / sum(timed),
                 "window_tokens_per_cpu_s": tokens_per_cpu_s(peak_dir, cpu_windows),
                 "peak_bytes_per_rank": peaks(peak_dir)}
            res[f"plain_{arm}"].append(r)
            arms.append(r)
        res["minimal"].append(max(arms, key=lambda r: statistics.median(r["window_tokens_per_s"])))
        for vname, env, flags in variants:
            tdir = run / f"trainer-{vname}"
            launch(a, str(REPO / "train" / "main.py"), ["--ds-config", str(ds), *trainer_args(a), "--data.path",
                   str(data), *flags, "--train.run_dir", str(tdir)], run / f"peak-{vname}",
                   run / f"trainer-{vname}.log", env)
            r = trainer_result(tdir, run / f"peak-{vname}", a)
            (res["trainer"] if vname == "defaults" else res["variants"][vname]).append(r)
        res.setdefault("load_avg_1min", []).append([load0, os.getloadavg()[0]])
    return summarize(res)


def trainer_result(run_dir: Path, peak_dir: Path, a) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in rows if "tokens_per_s" in r and "final/loss" not in r]
    # Timed windows run between consecutive log rows (their wall-clock "time"), logging included,
    # as the plain loop's clock runs over its whole steps: the rows of steps warmup, warmup+window, ...
    spans = [(p["time"], r["time"], r["tokens_seen"] - p["tokens_seen"]) for p, r in zip(train, train[1:])
             if p["step"] >= a.warmup]
    windows = [tokens / (end - start) for start, end, tokens in spans]
    timed_s = sum(end - start for start, end, _ in spans)
    mem = next((r for r in rows if "mem/model_states_bytes_per_rank" in r), {})
    losses = [r["loss"] for r in rows if "loss" in r]
    out = {"window_tokens_per_s": windows,
           "span_tokens_per_s": sum(t for _, _, t in spans) / timed_s if timed_s > 0 else None,
           "timed_steps": (train[-1]["step"] - a.warmup) if spans else 0,
           # the trainer's own tokens_per_s: step time only, without the log rows' work
           "reported_window_tokens_per_s": [r["tokens_per_s"] for r in train if r["step"] > a.warmup],
           "window_tokens_per_cpu_s": tokens_per_cpu_s(peak_dir, spans),
           "peak_bytes_per_rank": peaks(peak_dir),
           "measured_model_states_per_rank": mem.get("mem/model_states_bytes_per_rank"),
           "planned_model_states_per_rank": mem.get("plan/model_states_bytes_per_rank"),
           "measured_host_per_rank": mem.get("mem/host_bytes_per_rank"),
           "planned_host_per_rank": mem.get("plan/host_bytes_per_rank"),
           "measured": {k[4:]: v for k, v in mem.items() if k.startswith("mem/") and not k.endswith("per_rank")},
           "planned": {k[5:]: v for k, v in mem.items() if k.startswith("plan/") and not k.endswith("per_rank")},
           "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}
    cfg = run_dir / "config.json"
    if cfg.is_file():  # the planner's peak per rank that the run's memory check used (train/plan/memory_check.py)
        plan = json.loads(cfg.read_text())["resolved"].get("memory_plan") or {}
        out["planned_peak_bytes"] = (plan.get("device_bytes") or {}).get("total")
    mfu = [r["mfu"] for r in rows if "mfu" in r and r["step"] > a.warmup]
    if mfu:
        out["mfu"] = statistics.median(mfu)
    return out


def summarize(res: dict) -> dict:
    t = [w for r in res["trainer"] for w in r["window_tokens_per_s"]]
    m = [w for r in res["minimal"] for w in r["window_tokens_per_s"]]
    res["trainer_tokens_per_s"] = statistics.median(t) if t else None
    res["minimal_tokens_per_s"] = statistics.median(m) if m else None  # the best plain loop of each pair
    for arm in res.get("plain_arms", []):
        w = [x for r in res[f"plain_{arm}"] for x in r["window_tokens_per_s"]]
        res[f"plain_{arm}_tokens_per_s"] = statistics.median(w) if w else None
        res[f"pair_ratios_{arm}"] = pair_ratios(res["trainer"], res[f"plain_{arm}"])
    if t and m:
        res["throughput_ratio"] = res["trainer_tokens_per_s"] / res["minimal_tokens_per_s"]
        res["trainer_overhead"] = 1 - res["throughput_ratio"]
    # Per alternated pair (the best plain run of the same repeat): median ratio and spread.
    res["pair_ratios"] = pair_ratios(res["trainer"], res["minimal"])
    if res["pair_ratios"]:
        res["pair_ratio_median"] = statistics.median(res["pair_ratios"])
    res["variant_ratios"] = {k: pair_ratios(v, res["minimal"]) for k, v in res.get("variants", {}).items()}
    tc = [w for r in res["trainer"] for w in r["window_tokens_per_cpu_s"]]
    mc = [w for r in res["minimal"] for w in r["window_tokens_per_cpu_s"]]
    if tc and mc:
        res["trainer_tokens_per_cpu_s"], res["minimal_tokens_per_cpu_s"] = statistics.median(tc), statistics.median(mc)
        res["cpu_throughput_ratio"] = res["trainer_tokens_per_cpu_s"] / res["minimal_tokens_per_cpu_s"]
    last = res["trainer"][-1]
    meas, plan = last["measured_model_states_per_rank"], last["planned_model_states_per_rank"]
    if meas and plan and all(p > 0 for p in plan):
        res["planner_error_per_rank"] = [(p - mm) / mm for mm, p in zip(meas, plan)]
    res["peak_bytes_per_rank"] = last["peak_bytes_per_rank"]
    return res


def pair_ratios(trainer: list[dict], plain: list[dict]) -> list[float]:
    return [statistics.median(t["window_tokens_per_s"]) / statistics.median(p["window_tokens_per_s"])
            for t, p in zip(trainer, plain) if t["window_tokens_per_s"] and p["window_tokens_per_s"]]


def _ratios(rs: list[float]) -> str:
    if not rs:
        return "-"
    return f"{statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f}, n={len(rs)})"


def _arm_title(arm: str) -> str:
    return "torch default threads" if arm == "default" else arm.replace("thread", " thread/rank")


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def markdown(results: list[dict], meta: dict) -> str:
    arms = meta.get("plain_arms", [])
    lines = [f"Command: `{meta['command']}`  ", f"Machine: {meta['machine'].get('cpu')} "
             f"({meta['machine'].get('cpu_cores')} cores), {meta['machine'].get('gpus', 'no GPU')}, torch "
             f"{meta['machine'].get('torch')}, deepspeed {meta['machine'].get('deepspeed')}  ",
             f"Model: {meta['model']}, {meta['nproc']} processes, precision {meta['precision']}; "
             f"tokens/s = median of {meta['window']}-step wall-clock windows over steps {meta['warmup'] + 1}-"
             f"{meta['steps']} (after {meta['warmup']} warm-up steps); plain loop arms: "
             f"{', '.join(_arm_title(x) for x in arms)}, the best plain loop = the faster arm of each pair; "
             f"trainer/best plain = median (min-max) over alternated pairs; launcher {meta.get('launcher')}", "",
             "| config | trainer tok/s | " + "".join(f"plain {_arm_title(x)} tok/s | " for x in arms) +
             "best plain tok/s | trainer / best plain loop (pairs) | "
             + "".join(f"trainer / plain {_arm_title(x)} | " for x in arms) +
             "same, per CPU-second (rank 0) | peak MiB per rank | planner peak MiB (rank 0) | "
             "model states MiB per rank (measured) | planner MiB per rank | planner error | load avg |",
             "|---|---:|" + "---:|" * len(arms) + "---:|---|" + "---|" * len(arms) + "---:|---|---:|---|---|---|---|"]
    for r in results:
        t = r["trainer"][-1]
        ratio = _ratios(r.get("pair_ratios", []))
        arm_tps = "".join(f"{r.get(f'plain_{x}_tokens_per_s') or 0:,.0f} | " for x in arms)
        arm_ratios = "".join(f"{_ratios(r.get(f'pair_ratios_{x}', []))} | " for x in arms)
        cpu_ratio = f"{r['cpu_throughput_ratio']:.3f}" if r.get("cpu_throughput_ratio") else "-"
        err = ", ".join(f"{e:+.1%}" for e in r.get("planner_error_per_rank", [])) or "-"
        loads = ", ".join(f"{x:.1f}" for pair in r.get("load_avg_1min", []) for x in pair)
        lines.append(f"| {r['config']} | {r['trainer_tokens_per_s'] or 0:,.0f} | {arm_tps}"
                     f"{r['minimal_tokens_per_s'] or 0:,.0f} | {ratio} | {arm_ratios}{cpu_ratio} | {' / '.join(map(_mib, r['peak_bytes_per_rank']))} "
                     f"| {_mib(t.get('planned_peak_bytes'))} "
                     f"| {' / '.join(map(_mib, t['measured_model_states_per_rank'] or []))} "
                     f"| {' / '.join(map(_mib, t['planned_model_states_per_rank'] or []))} | {err} | {loads} |")
    if any(r.get("variant_ratios") for r in results):
        lines += ["", "| config | trainer run | tok/s | trainer / best plain loop (pairs) |", "|---|---|---:|---|"]
        for r in results:
            lines.append(f"| {r['config']} | defaults | {r['trainer_tokens_per_s'] or 0:,.0f} "
                         f"| {_ratios(r.get('pair_ratios', []))} |")
            for k, rs in r.get("variant_ratios", {}).items():
                tps = [w for x in r["variants"][k] for w in x["window_tokens_per_s"]]
                lines.append(f"| {r['config']} | {k} | {statistics.median(tps) if tps else 0:,.0f} | {_ratios(rs)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    unknown = [n for n in names if not (REPO / "ds_configs" / f"{n}.json").is_file()]
    if unknown:
        sys.exit(f"stages.py: unknown config(s) {', '.join(unknown)}; choose from "
                 f"{', '.join(p.stem for p in sorted((REPO / 'ds_configs').glob('*.json')))}")
    import torch
    cuda = torch.cuda.is_available()
    out_dir = Path(a.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tmp = out_dir / f"tmp-{stamp}"
    tmp.mkdir(parents=True, exist_ok=True)
    meta = {"command": shlex.join([Path(sys.executable).name, "bench/stages.py", *(sys.argv[1:] if argv is None
                                                                                     else argv)]),
            "machine": machine(), "model": f"{a.model} d_model={a.d_model} n_layer={a.n_layer} seq={a.seq_len} "
            f"micro={a.micro_batch} accum={a.grad_accum}", "nproc": a.nproc, "steps": a.steps, "launcher": a.launcher, "repeats": a.repeats, "variants": a.variant,
            "load_before": os.getloadavg()[0], "warmup": a.warmup, "window": a.window,
            "plain_arms": [arm for arm, _ in a.arms], "timed_steps": a.steps - a.warmup,
            "precision": a.precision if a.precision != "auto" else ("json" if cuda else "fp32"),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    results = []
    for name in names:
        print(f"[stages] {name} ...", flush=True)
        results.append(run_config(a, name, tmp, cuda))
        r = results[-1]
        print(f"[stages] {name}: trainer {r['trainer_tokens_per_s'] or 0:,.0f} tok/s, "
              + "".join(f"plain {x} {r[f'plain_{x}_tokens_per_s'] or 0:,.0f} tok/s, " for x in r["plain_arms"])
              + f"best plain {r['minimal_tokens_per_s'] or 0:,.0f} tok/s, trainer/best plain pairs "
              f"{_ratios(r['pair_ratios'])}", flush=True)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out_dir / f"stages-{stamp}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    md = markdown(results, meta)
    (out_dir / f"stages-{stamp}.md").write_text(md)
    print(md)
    print(f"[stages] wrote {out_dir / f'stages-{stamp}.json'} and .md (run logs in {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
