"""Checkpoint cadence: what a save costs, what a failure costs, and what cadence that implies.

Per model size and ZeRO stage (2 processes, torchrun, fp32 on CPU) two launches of train/main.py:

1. train `--steps` steps with `checkpoint.every_steps --save-every` (and a save at the end):
   the save time (wall s on rank 0: write + fsync + checksums + commit, `checkpoint/save_s`) and
   bytes (`checkpoint/bytes`) of every save, and the step time (`step_time_s`, save pauses
   excluded) after the warm-up;
2. `--resume auto` from its last checkpoint for 2 more steps: a restart's cost = launch to the
   first step logged (imports, process group, model build, checkpoint load, one step), and the
   load alone ("loaded in X s" of the resume line).

From those, for several cadences T: the time spent saving, save / (T + save), and the expected
work lost per failure, T/2 (a failure lands on average half way between two saves) + the
restart; and the Young/Daly optimum T* = sqrt(2 x save x MTBF) for a few MTBFs. Also the cost
of the every_minutes check itself (--vote-iters): the trainer's stop vote, a 2-process async
gloo all-reduce read one step later, with 1 float (before) and 2 (stop + ticket), per step.

Writes <out>/cadence-<timestamp>.json and .md (and prints the tables).

    python bench/checkpoint_cadence.py                    # default GPT + 78M GPT, ZeRO-2 and ZeRO-3
    python bench/checkpoint_cadence.py --sizes default --stages zero2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

# name -> extra args on top of examples/default.yaml (the default GPT: gpt-small-cpu, 0.8M params)
SIZES = {
    "default": [],
    "gpt-78m": ["--model.d_model", "768", "--model.n_layer", "12", "--train.micro_batch_size", "2"],
}
CADENCES_MIN = (1, 5, 10, 30, 60)
MTBF_H = (1, 24, 24 * 7)


def parse(argv):
    p = argparse.ArgumentParser(description="checkpoint cadence benchmark (BENCHMARKS.md)")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated: {', '.join(SIZES)}")
    p.add_argument("--stages", default="zero2,zero3", help="ds_configs/*.json names (run in fp32)")
    p.add_argument("--steps", type=int, default=8, help="steps of the first launch")
    p.add_argument("--save-every", type=int, default=2, help="checkpoint.every_steps of the first launch")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the step time")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--vote-iters", type=int, default=3000, help="stop-vote calls timed per variant (0: skip)")
    p.add_argument("--work", default=None, help="where the run directories go (default: a temp dir on /tmp's disk)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
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


def launch(a, args: list[str], log: Path) -> tuple[float, float, str]:
    """(wall start, wall end, output) of one torchrun launch of train/main.py."""
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.update(PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // a.nproc))))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc),
           "--master_port", str(free_port()), str(REPO / "train" / "main.py"), *args]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=a.timeout)
    t1 = time.time()
    log.write_text("$ " + shlex.join(cmd) + "\n" + proc.stdout)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed (exit {proc.returncode}); log {log}:\n{proc.stdout[-3000:]}")
    return t0, t1, proc.stdout


def fp32_json(stage: str, d: Path) -> Path:
    data = json.loads((REPO / "ds_configs" / f"{stage}.json").read_text())
    data["bf16"], data["fp16"] = {"enabled": False}, {"enabled": False}
    out = d / f"{stage}_fp32.json"
    out.write_text(json.dumps(data, indent=1))
    return out


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def num_params(model_cfg: dict) -> int:
    import torch
    from zerotrain.models.gpt import GPT, preset
    with torch.device("meta"):
        m = GPT(preset(model_cfg["name"], d_model=model_cfg.get("d_model"), n_layer=model_cfg.get("n_layer")))
    return sum(p.numel() for p in m.parameters())


def run_one(a, size: str, stage: str, work: Path) -> dict:
    d = work / f"{size}-{stage}"
    d.mkdir(parents=True, exist_ok=True)
    run = d / "run"
    common = ["--config", str(REPO / "examples" / "default.yaml"), *SIZES[size],
              "--ds-config", str(fp32_json(stage, d)), "--train.run_dir", str(run),
              "--train.eval_every", "0", "--train.sample_tokens", "0", "--logging.progress", "false",
              "--logging.every_steps", "1", "--checkpoint.export", "false", "--checkpoint.keep_last", "2",
              "--optim.warmup_steps", "2"]
    t0, t1, _ = launch(a, [*common, "--train.max_steps", str(a.steps), "--checkpoint.every_steps",
                           str(a.save_every), "--checkpoint.save_at_end", "true"], d / "train.log")
    first = rows(run)
    saves = [r for r in first if "checkpoint/save_s" in r]
    steps = [r for r in first if "step_time_s" in r and r["step"] > a.warmup]
    first_step = min(r["time"] for r in first if "loss" in r)
    # 2. the restart: resume the last checkpoint, 2 more steps
    r0, r1, out = launch(a, [*common, "--train.max_steps", str(a.steps + 2), "--checkpoint.save_at_end", "false",
                             "--resume", "auto"], d / "resume.log")
    m = re.search(r"resumed from .*? loaded in ([0-9.]+) s", out)
    resumed_first = min(r["time"] for r in rows(run) if "loss" in r and r["time"] >= r0)
    save_s = [r["checkpoint/save_s"] for r in saves]
    res = {"size": size, "stage": stage, "saves": len(saves), "save_s": save_s,
           "save_s_median": statistics.median(save_s), "bytes": saves[-1]["checkpoint/bytes"],
           "step_time_s_median": statistics.median(r["step_time_s"] for r in steps),
           "launch_to_first_step_s": first_step - t0, "train_launch_s": t1 - t0,
           "restart_to_first_step_s": resumed_first - r0, "resume_load_s": float(m.group(1)) if m else None,
           "params": num_params(json.loads((run / "config.json").read_text())["model"])}
    print(f"  {size} {stage}: save {res['save_s_median']:.2f} s ({res['bytes'] / 2**20:.1f} MiB), step "
          f"{res['step_time_s_median']:.3f} s, restart to first step {res['restart_to_first_step_s']:.1f} s "
          f"(load {res['resume_load_s']} s)", flush=True)
    return res


# ---------------------------------------------------------------------------- the vote's cost

def _vote_worker(rank: int, world: int, port: int, iters: int, out: str):
    """Times the trainer's StopVote call with the every_minutes ticket (train/training/tick.py)
    against the vote as it was before (1 float: fill_, async all-reduce, .item() of the previous
    one), on a real 2-process gloo group; only the call is timed, with a 2 ms pause in between (a
    "step": the reduction completes in the background, as in training)."""
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from zerotrain.train.checkpoint.cadence import SaveCadence
    from zerotrain.train.training.tick import StopVote

    class Acc:
        num_processes = world

    class OldVote:
        def __init__(self):
            self.buffers, self.turn, self.pending = [torch.zeros(1), torch.zeros(1)], 0, None

        def __call__(self, flag):
            t = self.buffers[self.turn]
            self.turn ^= 1
            t.fill_(float(flag))
            work = dist.all_reduce(t, async_op=True)
            previous, self.pending = self.pending, (work, t)
            if previous is not None:
                previous[0].wait()
                return previous[1].item() > 0
            return False

    res = {}
    for name in ("before", "ticket", "before", "ticket"):  # interleaved, twice
        spent = []
        if name == "before":
            vote = OldVote()
            call = lambda v=vote: v(False)  # noqa: E731
        else:
            vote, cad = StopVote(Acc(), 2), SaveCadence(0, 1.0, rank == 0)
            call = lambda v=vote, c=cad: v([0.0, c.ticket()])  # noqa: E731
        dist.barrier()
        for _ in range(iters):
            t = time.perf_counter()
            call()
            spent.append(time.perf_counter() - t)
            time.sleep(0.002)
        vote.pending[0].wait()
        res.setdefault(name, []).append(round(statistics.median(spent) * 1e6, 1))
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def vote_cost(a, work: Path) -> dict:
    import timeit
    import torch.multiprocessing as mp
    from zerotrain.train.checkpoint.cadence import SaveCadence
    out = work / "vote.json"
    mp.start_processes(_vote_worker, args=(2, free_port(), a.vote_iters, str(out)), nprocs=2, start_method="spawn")
    got = json.loads(out.read_text())
    cad = SaveCadence(0, 1.0, True)
    ticket_us = min(timeit.repeat(cad.ticket, number=100000, repeat=3)) / 100000 * 1e6
    return {"vote_1_float_median_us": got["before"], "vote_2_floats_median_us": got["ticket"],
            "ticket_us": round(ticket_us, 3), "iters": a.vote_iters}


# ---------------------------------------------------------------------------- the tables

def derived(r: dict) -> dict:
    save, restart = r["save_s_median"], r["restart_to_first_step_s"]
    cad = []
    for m in CADENCES_MIN:
        T = m * 60.0
        cad.append({"minutes": m, "steps": T / r["step_time_s_median"], "overhead": save / (T + save),
                    "lost_per_failure_min": (T / 2 + restart) / 60.0})
    daly = [{"mtbf_h": h, "optimum_min": math.sqrt(2 * save * h * 3600) / 60.0} for h in MTBF_H]
    return {"cadences": cad, "young_daly": daly}


def markdown(results: list[dict], vote: dict | None, meta: dict) -> str:
    lines = [f"Command: `{meta['command']}`  ", f"Date: {meta['date']}; machine: {meta['machine']}", "",
             "| model | params | stage | checkpoint | save (median, s) | saves | step (s) | first start: launch → "
             "step 1 (s) | restart: launch → first step (s) | resume load (s) | load avg (1 min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['stage']} | {r['bytes'] / 2**20:.1f} MiB | "
                     f"{r['save_s_median']:.2f} ({', '.join(f'{s:.2f}' for s in r['save_s'])}) | {r['saves']} | "
                     f"{r['step_time_s_median']:.3f} | {r['launch_to_first_step_s']:.1f} | "
                     f"{r['restart_to_first_step_s']:.1f} | {r['resume_load_s']} | "
                     f"{' → '.join(f'{x:.1f}' for x in r['load_avg_1min'])} |")
    lines += ["", "Cadence T: time spent saving = save / (T + save); expected loss per failure = T/2 + restart "
              "(minutes of work)", "",
              "| model | stage | " + " | ".join(f"T = {m} min" for m in CADENCES_MIN) + " |",
              "|---|---|" + "---|" * len(CADENCES_MIN)]
    for r in results:
        d = derived(r)
        cells = [f"{c['overhead'] * 100:.2g} % / {c['lost_per_failure_min']:.2f} min ({c['steps']:.0f} steps)"
                 for c in d["cadences"]]
        lines.append(f"| {r['size']} | {r['stage']} | " + " | ".join(cells) + " |")
    lines += ["", "Young/Daly optimum T* = sqrt(2 × save × MTBF)", "",
              "| model | stage | " + " | ".join(f"MTBF {h} h" for h in MTBF_H) + " |",
              "|---|---|" + "---|" * len(MTBF_H)]
    for r in results:
        lines.append(f"| {r['size']} | {r['stage']} | " + " | ".join(f"{x['optimum_min']:.1f} min"
                                                                     for x in derived(r)["young_daly"]) + " |")
    if vote:
        lines += ["", "Stop vote per step (2 processes, gloo, async, read one step later; median µs per call of "
                      f"{vote['iters']}, two interleaved rounds): 1 float (before) {vote['vote_1_float_median_us']}, "
                      f"2 floats (with the every_minutes ticket) {vote['vote_2_floats_median_us']}; rank 0's "
                      f"ticket() alone {vote['ticket_us']} µs"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(argv)
    from stages import machine
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="zt-cadence-", dir="/tmp"))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cmd_args = shlex.join(argv if argv is not None else sys.argv[1:])
    meta = {"command": f"python bench/checkpoint_cadence.py {cmd_args}".strip(),
            "date": time.strftime("%Y-%m-%d"), "machine": machine(), "work_dir": str(work),
            "filesystem": subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.strip()}
    print(f"run directories under {work}", flush=True)
    vote = vote_cost(a, work) if a.vote_iters else None
    if vote:
        print(f"  stop vote: {vote}", flush=True)
    results = []
    for size in a.sizes.split(","):
        for stage in a.stages.split(","):
            load0 = os.getloadavg()[0]
            results.append({**run_one(a, size, stage, work), "load_avg_1min": [load0, os.getloadavg()[0]]})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, "vote": vote, "results": [{**r, **derived(r)} for r in results]}
    (out / f"cadence-{stamp}.json").write_text(json.dumps(data, indent=1) + "\n")
    md = markdown(results, vote, {**meta, "machine": f"{meta['machine'].get('cpu')}, "
                                  f"{meta['machine'].get('cpu_cores')} cores, no GPU"})
    (out / f"cadence-{stamp}.md").write_text(md)
    print(md)
    print(f"written: {out / f'cadence-{stamp}.json'}, .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
