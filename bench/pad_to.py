"""Instruction data padded per batch (data.pad_to longest) against padded to seq_len: the
trainer's step time on heavy-tailed records, through real launches of train/main.py.

    flock /tmp/cpu.lock .venv/bin/python bench/pad_to.py [--pairs 3] [--steps 30] [--seq-len 512]

The records are bench/packing.py's (log-normal total length, median seq_len / 8). Each pair runs
both layouts back to back, alternating which goes first, so a shared machine's load falls on both
alike; each run's figure is the median step_time_s of its log rows after the first 5 steps
(compile-free warm-up). Prints one JSON line per run, then the medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from packing import write_records  # noqa: E402


def run(path: Path, pad_to: str, a, run_dir: Path) -> dict:
    cmd = [sys.executable, str(ROOT / "train" / "main.py"), "--model.name", a.model, "--model.seq_len", str(a.seq_len),
           "--data.kind", "sft", "--data.path", str(path), "--data.seq_len", str(a.seq_len), "--data.pad_to", pad_to,
           "--data.val_fraction", "0", "--train.eval_batches", "0", "--train.micro_batch_size", str(a.micro),
           "--train.max_steps", str(a.steps), "--train.sample_tokens", "0", "--logging.progress", "false",
           "--logging.every_steps", "1", "--logging.trackers", "jsonl", "--checkpoint.export", "false",
           "--checkpoint.save_at_end", "false", "--ds-config", str(ROOT / "ds_configs" / "zero2_fp32.json"),
           "--train.run_dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "step_time_s" in r and r["step"] > 5]
    return {"pad_to": pad_to, "step_time_s": statistics.median(r["step_time_s"] for r in rows),
            "pad_fraction": round(statistics.mean(r["data/pad_fraction"] for r in rows), 3),  # of the batches as built
            "loss_last": rows[-1]["loss"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--records", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--model", default="gpt-small-cpu")
    a = ap.parse_args()
    out = {"seq_len": [], "longest": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_records(Path(tmp) / "sft.jsonl", a.records, a.seq_len)
        for p in range(a.pairs):
            order = ("seq_len", "longest") if p % 2 == 0 else ("longest", "seq_len")
            for pad_to in order:
                r = run(path, pad_to, a, Path(tmp) / f"{pad_to}_{p}")
                out[pad_to].append(r["step_time_s"])
                print(json.dumps({"pair": p, **r}), flush=True)
    med = {k: statistics.median(v) for k, v in out.items()}
    print(json.dumps({"model": a.model, "seq_len": a.seq_len, "micro": a.micro, "records": a.records,
                      "median_step_time_s": med, "longest_over_seq_len": round(med["longest"] / med["seq_len"], 3)}))


if __name__ == "__main__":
    main()
