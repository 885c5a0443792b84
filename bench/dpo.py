"""Preference tuning (issue 40): tokens/s of DPO against SFT on the same records, and peak memory
per rank of each reference (frozen copy, LoRA adapters off, none), planned and measured.

Every run is `train/main.py` on 1 process (python launcher, ds_configs/ddp.json with fp32), the
model gpt-small-cpu on bytes, the records of `zerotrain.train.data.make_preferences` (the SFT
run reads the same records as {"prompt", "response": chosen}). Runs alternate (A, B, A, B ...)
so shared load hits every variant alike; the table gives medians over --repeats.

    tokens/s   median of the logged intervals after the first (metrics.jsonl `tokens_per_s`:
               DPO counts both sequences of a pair, 2 x seq_len tokens per sample)
    pairs/s    records per second (= samples/s)
    peak RSS   the run's max resident set (os.wait4), the planner's estimated peak from the banner
               (`memory estimated peak ...`) beside it

    .venv/bin/python bench/dpo.py [--steps 40] [--repeats 3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROTRAIN_", "WANDB_", "MALLOC_"))}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run(args: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, str(REPO / "train" / "main.py"), *args, "--train.run_dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][1:]
    sps = [r["samples_per_s"] for r in rows if "samples_per_s" in r][1:]
    planned = re.search(r"estimated peak ([\d.]+ \w+)", out)
    return {"tokens_per_s": statistics.median(tps), "samples_per_s": statistics.median(sps),
            "peak_rss_bytes": usage.ru_maxrss * 1024, "planned_peak": planned.group(1) if planned else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="gpt-small-cpu")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = p.parse_args(argv)
    from zerotrain.train.data.make_preferences import write
    tmp = Path(tempfile.mkdtemp(prefix="bench_dpo_"))
    pairs, _ = write(tmp / "pairs.jsonl", 2048, 64, 0)
    sft = tmp / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": r["prompt"], "response": r["chosen"]}) + "\n"
                           for r in map(json.loads, pairs.read_text().splitlines())))
    ds = json.loads((REPO / "ds_configs" / "ddp.json").read_text())
    ds["bf16"] = {"enabled": False}
    ds_path = tmp / "ddp_fp32.json"
    ds_path.write_text(json.dumps(ds))
    common = ["--model.name", a.model, "--data.seq_len", str(a.seq_len), "--train.micro_batch_size", str(a.micro),
              "--train.max_steps", str(a.steps), "--train.eval_every", "0", "--train.eval_batches", "1",
              "--train.sample_tokens", "0", "--logging.every_steps", "5", "--logging.progress", "false",
              "--logging.trackers", "jsonl", "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
              "--optim.warmup_steps", "0", "--ds-config", str(ds_path)]
    dpo = ["--data.kind", "preference", "--data.path", str(pairs), "--train.objective", "dpo"]
    variants = {
        "sft": ["--data.kind", "sft", "--data.path", str(sft)],
        "dpo sigmoid, frozen-copy reference": [*dpo],
        "dpo simpo, no reference": [*dpo, "--train.dpo.loss", "simpo"],
    }
    results = {k: [] for k in variants}
    for rep in range(a.repeats):
        for name, extra in variants.items():
            results[name].append(run(common + extra, tmp / f"{name.split(',')[0].replace(' ', '_')}_{rep}"))
    table = []
    for name, rs in results.items():
        table.append({"variant": name, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "samples_per_s": statistics.median(r["samples_per_s"] for r in rs),
                      "peak_rss_mib": statistics.median(r["peak_rss_bytes"] for r in rs) / 2 ** 20,
                      "planned_peak": rs[0]["planned_peak"], "runs": rs})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/dpo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "cpu_cores": os.cpu_count(), "args": vars(a) | {"out": str(a.out)}}
    (a.out / f"dpo-{stamp}.json").write_text(json.dumps({"meta": meta, "results": table}, indent=1) + "\n")
    print("| variant | tokens/s | pairs (samples)/s | peak RSS, measured | peak, planned |")
    print("|---|---|---|---|---|")
    for t in table:
        print(f"| {t['variant']} | {t['tokens_per_s']:.0f} | {t['samples_per_s']:.1f} | {t['peak_rss_mib']:.0f} MiB | "
              f"{t['planned_peak']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
