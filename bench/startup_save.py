"""Start-up time and checkpoint save time per strategy file: what bench/stages.py does not time.

For each config (ds_configs/<name>.json in fp32), alternated over --repeats rounds, one trainer
launch (torchrun, 2 processes) of the stage benchmark's model (d_model 256, n_layer 4, seq 256,
micro 8: bench/stages.py --issue41) for --steps steps, a synchronous checkpoint every 10 steps:

* start-up: from the launch to the first step's metrics.jsonl row (process start, imports,
  process group, model build and sharding, the first step itself);
* save blocked: the loop's `checkpoint/save_s` (median over the saves of the launch).

    python bench/startup_save.py --configs zero2,zero3,fsdp2 --repeats 3 --out bench/results

Writes <out>/startup-save-<timestamp>.json and prints the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="zero2,zero3,fsdp2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = p.parse_args(argv)
    from helpers import free_port, subprocess_env
    work = Path(tempfile.mkdtemp(prefix="startup-save-"))
    results: dict[str, list[dict]] = {c: [] for c in a.configs.split(",")}
    for r in range(a.repeats):
        for name in results:
            ds = json.loads((REPO / "ds_configs" / f"{name}.json").read_text())
            ds["bf16"], ds["fp16"] = {"enabled": False}, {"enabled": False}
            ds.pop("data_types", None)
            cfg = work / f"{name}.json"
            cfg.write_text(json.dumps(ds))
            run = work / f"{name}-{r}"
            cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                   str(REPO / "train" / "main.py"), "--config", str(REPO / "examples" / "default.yaml"),
                   "--strategy", str(cfg), "--model.d_model", "256", "--model.n_layer", "4", "--model.seq_len", "256",
                   "--data.seq_len", "256",
                   "--train.micro_batch_size", "8", "--train.max_steps", str(a.steps), "--train.eval_every", "0",
                   "--logging.every_steps", "1", "--logging.progress", "false", "--train.sample_tokens", "0",
                   "--checkpoint.every_steps", "10", "--checkpoint.export", "false", "--train.run_dir", str(run)]
            t0 = time.time()
            subprocess.run(cmd, cwd=REPO, env=subprocess_env({}), check=True, capture_output=True)
            rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
            first = next(x["time"] for x in rows if x.get("step") == 1 and "loss" in x)
            saves = [x["checkpoint/save_s"] for x in rows if "checkpoint/save_s" in x]
            results[name].append({"startup_s": first - t0, "save_blocked_s": statistics.median(saves),
                                  "checkpoint_bytes": next(x["checkpoint/bytes"] for x in rows if "checkpoint/bytes" in x)})
            print(f"[startup_save] {name} round {r}: {results[name][-1]}", flush=True)
    summary = {n: {k: statistics.median(x[k] for x in v) for k in v[0]} for n, v in results.items()}
    out = Path(a.out) / f"startup-save-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": results, "median": summary}, indent=1) + "\n")
    for n, s in summary.items():
        print(f"{n:8s} start-up {s['startup_s']:.1f} s   save blocked {s['save_blocked_s']:.3f} s   "
              f"checkpoint {s['checkpoint_bytes'] / 2**20:.1f} MiB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
