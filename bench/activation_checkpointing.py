"""Activation checkpointing: the memory it saves per rank, measured and as the planner predicts
it, and that it changes nothing else (losses).

An activation-heavy GPT setting (long sequences, small weights) is trained for a few steps on N
processes with model.activation_checkpointing off and on, under one DeepSpeed JSON (fp32 copy of
ds_configs/zero3.json by default). Peak per rank: the peak usage of the rank's memory cgroup
(bench/memcap.py; no limit); predicted: the peak in each run's config.json (train/plan/estimate.py).

    python bench/activation_checkpointing.py                       # the BENCHMARKS.md figures (~2 min)
    python bench/activation_checkpointing.py --config zero2 --micro-batch 4

Writes bench/results/actckpt-<timestamp>.{json,md}.
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
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(a.out)
    tmp = out_dir / f"tmp-actckpt-{stamp}"
    ds = family(a.precision, tmp / "configs") / f"{a.config}.json"
    base = ["--model.name", "gpt-small-cpu", "--model.d_model", str(a.d_model), "--model.n_layer", str(a.n_layer),
            "--model.seq_len", str(a.seq_len), "--data.seq_len", str(a.seq_len), "--data.max_bytes", "2000000",
            "--train.micro_batch_size", str(a.micro_batch), "--train.max_steps", str(a.steps),
            "--train.eval_every", "0", "--train.eval_batches", "1", "--train.sample_tokens", "0",
            "--logging.progress", "false", "--logging.every_steps", "1", "--checkpoint.save_at_end", "false",
            "--checkpoint.export", "false", "--ds-config", str(ds)]
    runs = {}
    for on in (False, True):
        key = "on" if on else "off"
        print(f"[actckpt] activation checkpointing {key} ...", flush=True)
        runs[key] = launch(a, [*base, "--model.activation_checkpointing", str(on).lower()], tmp / key, None)
        if runs[key]["rc"] != 0:
            sys.exit(f"actckpt: the run with checkpointing {key} failed; log {tmp / key / 'log'}")
        rows = [json.loads(x) for x in (tmp / key / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
        runs[key]["losses"] = [r["loss"] for r in rows if "loss" in r]
        runs[key]["step_time_s"] = [r["step_time_s"] for r in rows if "step_time_s" in r]
    off, on = runs["off"], runs["on"]
    measured = [o - n for o, n in zip(off["peak_bytes_per_rank"], on["peak_bytes_per_rank"])]
    predicted = off["planned_peak_bytes"] - on["planned_peak_bytes"]
    meta = {"command": shlex.join([Path(sys.executable).name, "bench/activation_checkpointing.py",
                                   *(sys.argv[1:] if argv is None else argv)]), "machine": machine(),
            "model": f"gpt-small-cpu d_model={a.d_model} n_layer={a.n_layer} seq={a.seq_len} micro={a.micro_batch}",
            "config": a.config, "precision": a.precision, "nproc": a.nproc, "started": stamp}
    result = {"meta": meta, "runs": runs, "measured_saving_per_rank": measured, "predicted_saving": predicted,
              "saving_error": [(predicted - m) / m for m in measured],
              "losses_identical": off["losses"] == on["losses"]}
    (out_dir / f"actckpt-{stamp}.json").write_text(json.dumps(result, indent=1) + "\n")
    md = [f"Command: `{meta['command']}`  ",
          f"Machine: {meta['machine'].get('cpu')} ({meta['machine'].get('cpu_cores')} cores), torch "
          f"{meta['machine'].get('torch')}  ",
          f"Model: {meta['model']}, {a.config} {a.precision}, {a.nproc} processes, {a.steps} steps", "",
          "| activation checkpointing | peak MiB per rank (measured) | peak MiB (planner) | step time s (median) |",
          "|---|---|---:|---:|"]
    for key in ("off", "on"):
        r = runs[key]
        st = sorted(r["step_time_s"])[len(r["step_time_s"]) // 2]
        md.append(f"| {key} | {' / '.join(f'{p / MiB:.0f}' for p in r['peak_bytes_per_rank'])} | "
                  f"{r['planned_peak_bytes'] / MiB:.0f} | {st:.2f} |")
    md += ["", f"Saving per rank: measured {' / '.join(f'{m / MiB:.0f}' for m in measured)} MiB, planner "
               f"{predicted / MiB:.0f} MiB ({', '.join(f'{e:+.1%}' for e in result['saving_error'])}); losses "
               f"{'identical' if result['losses_identical'] else 'DIFFERENT'} ({off['losses']} vs {on['losses']})."]
    text = "\n".join(md) + "\n"
    (out_dir / f"actckpt-{stamp}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
