"""Peak RSS of a training process reading instruction data from parquet (through `datasets`,
memory-mapped, rows read 1,024 at a time) against the JSONL path on the same records and
against a 10 MB parquet set (issue 48).

Writes TRL prompt-completion records (random lowercase words; ~2 KB each) as JSONL and parquet
of --mb megabytes (default 1024) and the first 10 MB of them as parquet, then trains each for
3 steps in its own process (python launcher, 1 process: a rank's data path does not depend on
the others; gpt-tiny on bytes, data.seq_len 64, no evaluation) and reads that process's peak
RSS (ru_maxrss from wait4) and wall time. Each record keeps its first seq_len + 1 tokens per
rank (4 + 1 bytes a token), as from JSONL: that, not the table, is what grows with the set.

    .venv/bin/python bench/table_memory.py [--mb 1024] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SEQ_LEN = 64
RECORD_BYTES = 2048


def write_sets(d: Path, mb: int) -> dict[str, Path]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz    ", dtype=np.uint8)
    n = mb * (1 << 20) // RECORD_BYTES
    small_n = 10 * (1 << 20) // RECORD_BYTES
    paths = {"jsonl": d / "big.jsonl", "parquet": d / "big.parquet", "parquet 10 MB": d / "small.parquet"}
    writer = pq.ParquetWriter(str(paths["parquet"]), pa.schema([("prompt", pa.string()), ("completion", pa.string())]))
    small = []
    with open(paths["jsonl"], "w") as jf:
        for start in range(0, n, 4096):
            k = min(4096, n - start)
            text = letters[rng.integers(0, len(letters), size=k * RECORD_BYTES)].tobytes().decode()
            rows = [(text[i * RECORD_BYTES:i * RECORD_BYTES + 40], text[i * RECORD_BYTES + 40:(i + 1) * RECORD_BYTES])
                    for i in range(k)]
            jf.write("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in rows))
            writer.write_table(pa.table({"prompt": [p for p, _ in rows], "completion": [c for _, c in rows]}))
            if len(small) < small_n:
                small += rows[:small_n - len(small)]
    writer.close()
    pq.write_table(pa.table({"prompt": [p for p, _ in small], "completion": [c for _, c in small]}),
                   str(paths["parquet 10 MB"]))
    return paths


def train(path: Path, run_dir: Path, env: dict) -> tuple[int, float, str]:
    """(peak RSS bytes, seconds, the banner's data line) of one 3-step run."""
    cmd = [sys.executable, str(REPO / "train" / "main.py"), "--model.name", "gpt-tiny", "--data.kind", "sft",
           "--data.path", str(path), "--data.seq_len", str(SEQ_LEN), "--data.val_fraction", "0",
           "--train.micro_batch_size", "8", "--train.max_steps", "3", "--train.eval_every", "0",
           "--logging.progress", "false", "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
           "--train.sample_tokens", "0", "--ds-config", str(REPO / "ds_configs" / "ddp.json"),
           "--logging.trackers", "jsonl", "--train.run_dir", str(run_dir)]
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(run_dir / "out.txt", "w") as out, open(run_dir / "err.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS (ru_maxrss, KiB)
    seconds = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexit {status}\n{(run_dir / 'err.txt').read_text()[-3000:]}")
    line = next((ln.strip() for ln in (run_dir / "out.txt").read_text().splitlines()
                 if ln.strip().startswith("data ")), "?")
    return usage.ru_maxrss * 1024, seconds, line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--keep", help="write the sets here (and keep them) instead of a temp dir")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="where the JSON of the results goes")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(a.keep or tmp)
        d.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        paths = write_sets(d, a.mb)
        print(f"wrote {', '.join(f'{k} {p.stat().st_size / 2**20:,.0f} MiB' for k, p in paths.items())} "
              f"in {time.perf_counter() - t0:.0f} s", flush=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_DATASETS_CACHE=str(d / "ds_cache"),
                   CUDA_VISIBLE_DEVICES="", ZEROTRAIN_DEVICE="cpu", PYTHONWARNINGS="ignore")
        res = {}
        for name in ("parquet 10 MB", "parquet", "jsonl"):
            res[name] = train(paths[name], d / f"run_{name.replace(' ', '_')}", env)
            rss, s, line = res[name]
            print(f"{name:>14}: peak RSS {rss / 2**20:,.0f} MiB, {s:.0f} s   [{line[:150]}]", flush=True)
        big, small, jsonl = res["parquet"][0], res["parquet 10 MB"][0], res["jsonl"][0]
        print(f"parquet {a.mb} MB / parquet 10 MB = {big / small:.2f}x; parquet / JSONL on the same records = "
              f"{big / jsonl:.2f}x")
        out = Path(a.out) / f"table_memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"mb": a.mb, "seq_len": SEQ_LEN, "record_bytes": RECORD_BYTES,
                                   "runs": {k: {"peak_rss_bytes": r, "seconds": round(t, 1), "data": line}
                                            for k, (r, t, line) in res.items()},
                                   "big_over_small": big / small, "parquet_over_jsonl": big / jsonl}, indent=1) + "\n")
        print(f"results: {out}")


if __name__ == "__main__":
    main()
