"""Data at pre-training scale: does the default GPT ever wait for data, and does a rank's memory
grow with the corpus?

Generates synthetic byte-level corpora of many shards (default 1 GB and 10 GB of uint16 tokens,
32 MiB shards) with the real writer (train/data/prepare_pool.py ShardWriter: fsynced shards,
sha256 of every byte written, manifest_meta), so `zerotrain prepare --verify DIR` passes on
them. The content is real, not sparse: a 32 MiB block of uniform random byte ids, each 16M-token
chunk a rotation of it plus a random offset mod 256 (fast to make, incompressible, every
shard different); sparse zero files would be read from no disk at all. Before every run the
shards are dropped from the page cache (posix_fadvise DONTNEED), so each run starts cold and
reads from disk as a fresh corpus would.

Then trains the default GPT (examples/default.yaml, ds_configs/zero2_fp32.json on a CPU, the
`make train` setup) on N processes (torchrun) for --steps steps on each corpus, with
data.num_workers 0 and with the auto default, plus (--mixture) a 50/50 data.sources mixture
of the two corpora, and reports per run from metrics.jsonl (every interval but the first,
which holds start-up): median step_time_s and data_wait_s (the worst rank's, as logged),
the data-wait share (total wait / total step time) and the worst interval's share; and
peak RSS per rank (bench/rank_peak.py: the rank process's lifetime VmHWM), and the peak of
rank + its DataLoader workers in PSS (sampled every second from /proc/*/smaps_rollup: a
forked worker's RSS counts the pages it shares with its rank, PSS splits them).

    python bench/data_scale.py                          # the BENCHMARKS.md table (~15 min)
    python bench/data_scale.py --sizes-gb 0.05,0.5 --steps 30 --dir /data/scratch

Corpora are kept in --dir (default bench/results/data_scale/, git-ignored) and reused by
later runs with the same parameters; --clean deletes them at the end.
Writes bench/results/data_scale-<timestamp>.{json,md}.
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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stages import BIN, REPO, free_port, machine  # noqa: E402

sys.path.insert(0, str(REPO))
GB = 10 ** 9
BASE_TOKENS = 1 << 24  # the random block every chunk is a rotation of (32 MiB of uint16)


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-gb", default="1,10", help="corpus sizes in GB of tokens (10^9 bytes)")
    p.add_argument("--shard-mib", type=float, default=32, help="shard size")
    p.add_argument("--dir", default=str(REPO / "bench" / "results" / "data_scale"), help="where corpora are made")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    p.add_argument("--every", type=int, default=10, help="logging interval (steps)")
    p.add_argument("--workers", default="0,auto", help="data.num_workers settings to run (auto = unset)")
    p.add_argument("--mixture", action=argparse.BooleanOptionalAction, default=True,
                   help="also a 50/50 mixture of the smallest and largest corpus (auto workers)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="examples/default.yaml")
    p.add_argument("--ds-config", default=None, help="default: zero2.json on a GPU, zero2_fp32.json on a CPU")
    p.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    p.add_argument("--clean", action="store_true", help="delete the generated corpora at the end")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = p.parse_args(argv)
    a.sizes = [float(x) for x in a.sizes_gb.split(",") if x.strip()]
    a.worker_settings = [w.strip() for w in a.workers.split(",") if w.strip()]
    bad = [w for w in a.worker_settings if w != "auto" and not w.isdigit()]
    if bad or not a.sizes or a.steps < 2 * a.every:  # (--workers "" --mixture: only the mixture run)
        p.error("--workers takes integers or auto; --steps must cover at least two logging intervals")
    return a


# ----------------------------------------------------------------------------- corpus

def corpus_dir(a, gb: float) -> Path:
    return Path(a.dir) / f"corpus-{gb:g}GB-{a.shard_mib:g}MiB"


def generate(out: Path, nbytes: int, shard_tokens: int, seed: int = 0, vocab: int = 256) -> dict:
    """A shard set of nbytes of uint16 tokens < vocab, written and hashed by ShardWriter."""
    import numpy as np

    from zerotrain.train.data.prepare_pool import ShardWriter, manifest_meta, write_manifest
    from zerotrain.train.data.shards import MANIFEST
    source = {"generator": "bench/data_scale.py", "bytes": nbytes, "shard_tokens": shard_tokens, "seed": seed,
              "vocab": vocab}
    if (out / MANIFEST).is_file():
        meta = json.loads((out / MANIFEST).read_text())
        if meta.get("source") == source:
            return meta
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, size=BASE_TOKENS, dtype=np.uint16)
    writer = ShardWriter(out, "shard", np.uint16, shard_tokens, [], on_shard=lambda entry: None)
    left, t0 = nbytes // 2, time.perf_counter()
    while left:
        n = min(BASE_TOKENS, left)
        start, shift = int(rng.integers(0, BASE_TOKENS)), int(rng.integers(1, vocab))
        chunk = np.concatenate((base[start:], base[:start]))[:n]
        chunk += np.uint16(shift)
        chunk %= np.uint16(vocab)
        writer.write(chunk, lambda k: None)
        left -= n
    writer.close(None)
    meta = manifest_meta(np.uint16, vocab, "bytes", shard_tokens, {"shards": writer.entries}, 0, source)
    write_manifest(out, meta)
    print(f"[data_scale] wrote {out}: {len(writer.entries)} shards, {nbytes / GB:g} GB in "
          f"{time.perf_counter() - t0:.0f} s (sha256 included)", flush=True)
    return meta


def evict(d: Path) -> None:
    """Drop the shards from the page cache (clean pages: no root needed), so a run reads from disk."""
    for p in d.glob("*.bin"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- memory sampling

def _children(pid: int) -> list[int]:
    """Child processes of every thread of pid (a child belongs to the thread that forked it)."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PssSampler(threading.Thread):
    """Every second: for each rank (a child of the launcher), PSS of the rank + all its
    descendants (DataLoader workers); keeps the peak per rank and the most workers seen."""

    def __init__(self, launcher_pid: int):
        super().__init__(daemon=True)
        self.root, self.stop, self.peak, self.workers = launcher_pid, threading.Event(), {}, {}

    def run(self):
        while not self.stop.wait(1.0):
            for i, rank in enumerate(sorted(_children(self.root))):
                tree, todo = [], [rank]
                while todo:
                    pid = todo.pop()
                    tree.append(pid)
                    todo += _children(pid)
                self.peak[i] = max(self.peak.get(i, 0), sum(_pss(p) for p in tree))
                self.workers[i] = max(self.workers.get(i, 0), len(tree) - 1)


# ----------------------------------------------------------------------------- runs

def launch(a, name: str, overrides: list[str], tmp: Path) -> dict:
    import torch
    run_dir, peak_dir, log = tmp / name, tmp / f"{name}.peaks", tmp / f"{name}.log"
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(peak_dir, ignore_errors=True)
    ds = a.ds_config or ("ds_configs/zero2.json" if torch.cuda.is_available() else "ds_configs/zero2_fp32.json")
    args = ["--config", a.config, "--ds-config", ds, "--data.kind", "tokens", *overrides,
            "--train.max_steps", str(a.steps), "--logging.every_steps", str(a.every),
            "--train.eval_every", "0", "--train.eval_batches", "2", "--train.sample_tokens", "0",
            "--logging.progress", "false", "--checkpoint.every_steps", "0", "--checkpoint.save_at_end", "false",
            "--checkpoint.export", "false", "--train.run_dir", str(run_dir)]
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env["PATH"] = str(BIN) + os.pathsep + env.get("PATH", "")
    env.update(ZT_PEAK_DIR=str(peak_dir), PYTHONUNBUFFERED="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_port",
           str(free_port()), str(REPO / "bench" / "rank_peak.py"), "train/main.py", *args]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
        sampler = PssSampler(proc.pid)
        sampler.start()
        try:
            rc = proc.wait(timeout=a.timeout)
        finally:
            sampler.stop.set()
            if proc.poll() is None:
                proc.kill()
    if rc != 0:
        tail = "\n".join(log.read_text().splitlines()[-25:])
        raise RuntimeError(f"{name} failed (exit {rc}); log {log}:\n{tail}")
    return summarize(name, run_dir, peak_dir, sampler, time.perf_counter() - t0, overrides)


def summarize(name: str, run_dir: Path, peak_dir: Path, sampler: PssSampler, wall: float, overrides) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "step_time_s" in r][1:]  # the first interval holds start-up
    steps = [r["step_time_s"] for r in rows]
    waits = [r["data_wait_s"] for r in rows]
    peaks = sorted(peak_dir.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    resolved = json.loads((run_dir / "config.json").read_text())["resolved"]
    return {"name": name, "overrides": overrides, "intervals": len(rows), "wall_s": round(wall, 1),
            "data_workers": resolved["hardware"]["data_workers"],
            "median_step_time_s": statistics.median(steps), "median_data_wait_s": statistics.median(waits),
            "data_wait_share": sum(waits) / sum(steps),
            "worst_interval_share": max(w / s for w, s in zip(waits, steps)),
            "peak_rss_per_rank": [json.loads(p.read_text())["max_rss_bytes"] for p in peaks],
            "trainer_peak_mem_bytes": max(r["peak_mem_bytes"] for r in rows),
            "peak_pss_rank_and_workers": [sampler.peak.get(i) for i in sorted(sampler.peak)],
            "workers_seen_per_rank": [sampler.workers.get(i) for i in sorted(sampler.workers)],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r)}


def _mib(n) -> str:
    return "-" if n is None else f"{n / 2 ** 20:,.0f}"


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"Data at scale: {meta['model']}, {meta['nproc']} processes, {meta['steps']} steps "
             f"(logging every {meta['every']}; medians over intervals 2..), {meta['machine']['cpu']} "
             f"({meta['machine']['cpu_cores']} cores); started {meta['started']}", "",
             f"    {meta['command']}", "",
             "| run | corpus | workers/rank | median step_time_s | median data_wait_s | data wait share | worst interval "
             "| peak RSS per rank (MiB) | peak PSS rank+workers (MiB) | tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['name']} | {r['corpus']} | {r['data_workers']} | {r['median_step_time_s']:.3f} | "
                     f"{r['median_data_wait_s'] * 1e3:.2f} ms | {r['data_wait_share']:.2%} | "
                     f"{r['worst_interval_share']:.2%} | {' / '.join(map(_mib, r['peak_rss_per_rank']))} | "
                     f"{' / '.join(map(_mib, r['peak_pss_rank_and_workers']))} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    out_dir = Path(a.out)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    tmp = out_dir / f"tmp-data_scale-{stamp}"
    tmp.mkdir(parents=True, exist_ok=True)
    shard_tokens = int(a.shard_mib * 2 ** 20) // 2
    corpora = {}
    for gb in a.sizes:
        d = corpus_dir(a, gb)
        meta = generate(d, int(gb * GB), shard_tokens)
        corpora[gb] = (d, f"{gb:g} GB, {len(meta['shards'])} shards")
    meta = {"command": shlex.join([Path(sys.executable).name, "bench/data_scale.py", *(sys.argv[1:] if argv is None
                                                                                        else argv)]),
            "machine": machine(), "model": f"{a.config} ({a.ds_config or 'zero2 / zero2_fp32 on CPU'})",
            "nproc": a.nproc, "steps": a.steps, "every": a.every, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "corpus_content": "random byte ids (real data on disk, not sparse); page cache dropped before each run"}
    plan = []
    for gb in a.sizes:
        for w in a.worker_settings:
            extra = [] if w == "auto" else ["--data.num_workers", w]
            plan.append((f"{gb:g}GB-w{w}", [corpora[gb][0]], corpora[gb][1], ["--data.path", str(corpora[gb][0])]
                         + extra))
    if a.mixture and len(a.sizes) > 1:
        lo, hi = corpora[min(a.sizes)], corpora[max(a.sizes)]
        sources = f"[{{path: {lo[0]}, weight: 1}}, {{path: {hi[0]}, weight: 1}}]"
        plan.append(("mixture-wauto", [lo[0], hi[0]], f"mixture 50/50 of {lo[1]} + {hi[1]}",
                     ["--data.sources", sources]))
    results = []
    for name, dirs, corpus, overrides in plan:
        for d in dirs:
            evict(d)
        print(f"[data_scale] {name} ...", flush=True)
        r = launch(a, name, overrides, tmp)
        r["corpus"] = corpus
        results.append(r)
        print(f"[data_scale] {name}: step {r['median_step_time_s']:.3f} s, data wait {r['data_wait_share']:.2%}, "
              f"peak RSS/rank {' / '.join(map(_mib, r['peak_rss_per_rank']))} MiB", flush=True)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out_dir / f"data_scale-{stamp}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    md = markdown(results, meta)
    (out_dir / f"data_scale-{stamp}.md").write_text(md)
    print(md)
    print(f"[data_scale] wrote {out_dir / f'data_scale-{stamp}.json'} and .md (run logs in {tmp})")
    if a.clean:
        for d, _ in corpora.values():
            shutil.rmtree(d, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
