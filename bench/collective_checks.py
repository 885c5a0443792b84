"""What debug.collectives (torch's collective fingerprint check) costs per training step.

Runs `train/main.py` on N torchrun processes, alternately with --debug.collectives false and
true (off first, then on: one pair), several pairs, for each DeepSpeed JSON; each run logs every
step, and a run's step time is the median of its `step_time_s` after the warm-up steps. Reports
per JSON the median step time off and on over the pairs and the median of the per-pair ratios
(on / off - 1): the cost the check adds to a step. Alternating lets a shared machine's load hit
both sides alike.

    python bench/collective_checks.py                          # examples/default.yaml, ddp + zero2 + zero3, 3 pairs
    python bench/collective_checks.py --configs ddp --pairs 5 --steps 40

Writes bench/results/collective_checks-<stamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/default.yaml")
    p.add_argument("--configs", default="ddp,zero2,zero3", help="ds_configs/<name>.json, comma-separated")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    return p.parse_args(argv)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(a, ds: str, on: bool) -> float:
    """Median step time (s) of one launch."""
    run_dir = tempfile.mkdtemp(prefix="collective-checks-")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ZEROTRAIN_", "MALLOC_", "TORCH_DISTRIBUTED_DEBUG")) and k != "THP_MEM_ALLOC_ENABLE"}
    env.update(WANDB_MODE="disabled", PYTHONWARNINGS="ignore", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_port",
           str(_port()), str(REPO / "train" / "main.py"), "--config", a.config,
           "--ds-config", str(REPO / "ds_configs" / f"{ds}.json"), "--train.run_dir", run_dir,
           "--train.max_steps", str(a.steps), "--logging.every_steps", "1", "--train.eval_every", "0",
           "--train.sample_tokens", "0", "--checkpoint.every_steps", "0", "--checkpoint.save_at_end", "false",
           "--checkpoint.export", "false", "--logging.progress", "false",
           "--debug.collectives", "true" if on else "false"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > a.warmup]
    return statistics.median(times)


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    results = {}
    for ds in a.configs.split(","):
        pairs = []
        for i in range(a.pairs):
            off = one_run(a, ds, False)
            on = one_run(a, ds, True)
            pairs.append({"off_s": off, "on_s": on, "cost": on / off - 1})
            print(f"{ds} pair {i + 1}: off {off * 1e3:.1f} ms  on {on * 1e3:.1f} ms  ({100 * (on / off - 1):+.1f} %)",
                  flush=True)
        results[ds] = {"pairs": pairs, "off_s": statistics.median(p["off_s"] for p in pairs),
                       "on_s": statistics.median(p["on_s"] for p in pairs),
                       "cost": statistics.median(p["cost"] for p in pairs)}
    lines = [f"debug.collectives per-step cost: {a.config}, {a.nproc} torchrun processes, {a.steps} steps per run "
             f"(median step time after {a.warmup}), {a.pairs} alternated off/on pairs", "",
             "| ds_config | step off (ms) | step on (ms) | cost (median of pair ratios) |", "|---|---|---|---|"]
    for ds, r in results.items():
        lines.append(f"| {ds} | {r['off_s'] * 1e3:.1f} | {r['on_s'] * 1e3:.1f} | {100 * r['cost']:+.1f} % |")
    text = "\n".join(lines) + "\n"
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"collective_checks-{stamp}.json").write_text(json.dumps({"args": vars(a), "results": results}, indent=1) + "\n")
    (out / f"collective_checks-{stamp}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
