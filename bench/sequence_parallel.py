"""Ulysses sequence parallelism: the activation memory it saves per rank, measured and as the
planner predicts it, and that the losses stay those of the run without it.

A long-sequence GPT (small weights, activation checkpointing on) is trained for a few steps on 2
processes with distributed.sequence_parallel 1 (each rank a whole row) and 2 (each rank half of
one row), under one DeepSpeed JSON (fp32 copy of ds_configs/zero3.json by default): model states
are the same in both, so the difference is the activations and the all-to-all buffers. Peak per
rank: the peak usage of the rank's memory cgroup (bench/memcap.py; no limit); predicted: the peak
in each run's config.json (train/plan/estimate.py). The runs use compact malloc by default
(--host-malloc): the planner counts live tensors, and with glibc's default allocator a long row's
freed activation blocks stay resident (glibc raises its mmap threshold after the first large free,
so later blocks come from a heap that is not trimmed), which is allocator growth, not activations
(BENCHMARKS.md "Sequence parallelism"). (With SP 1 the 2 ranks train on 2 rows per
step, with SP 2 on one: the losses are compared by bench/../tests/test_sequence_parallel.py, not here.)

    python bench/sequence_parallel.py                       # the BENCHMARKS.md figures
    python bench/sequence_parallel.py --seq-len 16384 --n-layer 2

Writes bench/results/seqpar-<timestamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import family, launch  # noqa: E402
from stages import REPO, machine  # noqa: E402

MiB = 2 ** 20


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="zero3", help="ds_configs/<name>.json")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "json"))
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--host-malloc", default="compact", choices=("compact", "glibc"),
                   help="hardware.host_malloc of both runs (compact: resident memory follows live tensors)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    a.nproc = 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(a.out)
    tmp = out_dir / f"tmp-seqpar-{stamp}"
    ds = family(a.precision, tmp / "configs") / f"{a.config}.json"
    base = ["--model.name", "gpt-small-cpu", "--model.d_model", str(a.d_model), "--model.n_layer", str(a.n_layer),
            "--model.seq_len", str(a.seq_len), "--data.seq_len", str(a.seq_len), "--data.max_bytes", "2000000",
            "--model.activation_checkpointing", "true", "--train.micro_batch_size", "1",
            "--train.max_steps", str(a.steps), "--train.eval_every", "0", "--train.eval_batches", "1",
            "--train.sample_tokens", "0", "--logging.progress", "false", "--logging.every_steps", "1",
            "--checkpoint.save_at_end", "false", "--checkpoint.export", "false", "--hardware.host_malloc", a.host_malloc, "--ds-config", str(ds)]
    runs = {}
    for n in (1, 2):
        key = f"sp{n}"
        print(f"[seqpar] sequence_parallel {n} ...", flush=True)
        runs[key] = launch(a, [*base, "--distributed.sequence_parallel", str(n)], tmp / key, None)
        if runs[key]["rc"] != 0:
            sys.exit(f"seqpar: the run with sequence_parallel {n} failed; log {tmp / key / 'log'}")
        rows = [json.loads(x) for x in (tmp / key / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        runs[key]["losses"] = [r["loss"] for r in rows if "loss" in r]
        runs[key]["step_time_s"] = [r["step_time_s"] for r in rows if "step_time_s" in r]
        runs[key]["tokens_per_s"] = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
    one, two = runs["sp1"], runs["sp2"]
    measured = [o - t for o, t in zip(one["peak_bytes_per_rank"], two["peak_bytes_per_rank"])]
    predicted = one["planned_peak_bytes"] - two["planned_peak_bytes"]
    meta = {"command": shlex.join([Path(sys.executable).name, "bench/sequence_parallel.py",
                                   *(sys.argv[1:] if argv is None else argv)]), "machine": machine(),
            "model": f"gpt-small-cpu d_model={a.d_model} n_layer={a.n_layer} seq={a.seq_len} micro=1, "
                     f"activation checkpointing, {a.host_malloc} malloc", "config": a.config, "precision": a.precision, "nproc": 2,
            "started": stamp}
    result = {"meta": meta, "runs": runs, "measured_saving_per_rank": measured, "predicted_saving": predicted,
              "saving_error": [(predicted - m) / m for m in measured]}
    (out_dir / f"seqpar-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [f"Command: `{meta['command']}`  ",
          f"Machine: {meta['machine'].get('cpu')} ({meta['machine'].get('cpu_cores')} cores), torch "
          f"{meta['machine'].get('torch')}  ",
          f"Model: {meta['model']}, {a.config} {a.precision}, 2 processes, {a.steps} steps", "",
          "| seq len | SP | peak MiB per rank (measured) | peak MiB (planner) | step time s (median) | tokens/s |",
          "|---:|---:|---|---:|---:|---:|"]
    for n, key in ((1, "sp1"), (2, "sp2")):
        r = runs[key]
        st = sorted(r["step_time_s"])[len(r["step_time_s"]) // 2] if r["step_time_s"] else float("nan")
        tps = sorted(r["tokens_per_s"])[len(r["tokens_per_s"]) // 2] if r["tokens_per_s"] else float("nan")
        md.append(f"| {a.seq_len} | {n} | {' / '.join(f'{p / MiB:.0f}' for p in r['peak_bytes_per_rank'])} | "
                  f"{r['planned_peak_bytes'] / MiB:.0f} | {st:.2f} | {tps:.0f} |")
    md += ["", f"Saving per rank: measured {' / '.join(f'{m / MiB:.0f}' for m in measured)} MiB, planner "
               f"{predicted / MiB:.0f} MiB ({', '.join(f'{e:+.1%}' for e in result['saving_error'])})."]
    text = "\n".join(md) + "\n"
    (out_dir / f"seqpar-{stamp}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
