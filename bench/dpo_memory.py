"""Preference tuning (issue 40 item 8): peak memory per rank of full fine-tuning with a live
reference (a frozen fp32 copy of the model) against a precomputed one (`zerotrain prepare
--reference`: two floats per record read from <data>.reference.safetensors), planned and measured.

The model is gpt-small-cpu widened (--d-model 384, --n-layer 6: ~10.9 M parameters, so the frozen
copy is ~42 MiB, above the RSS noise of a CPU run). Variants, alternated (A, B, A, B ...) so shared
load hits each alike, medians over --repeats:

    ddp live          1 process, ds_configs/ddp.json with fp32, train.dpo.reference live
    ddp precomputed   1 process, the same, train.dpo.reference precomputed
    zero3 precomputed 2 processes (torchrun), ds_configs/zero3.json with fp32 (--zero3; ZeRO-3 full
                      fine-tuning refuses a live reference: only precomputed, simpo or LoRA run there)

    measured  each rank's max RSS (bench/rank_peak.py: the whole process, Python and imports included)
    planned   the run's memory plan as config.json records it (`memory_plan`: the peak the memory
              check compared with the budget, and its params / activations terms), and the banner's
              `memory ... estimated peak` line

    .venv/bin/python bench/dpo_memory.py [--steps 10] [--repeats 3] [--zero3] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO))


def _env(peak_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROTRAIN_", "WANDB_", "MALLOC_"))}
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["ZT_PEAK_DIR"] = str(peak_dir)
    env["OMP_NUM_THREADS"] = "1"
    return env


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run(nproc: int, args: list[str], run_dir: Path) -> dict:
    peak_dir = run_dir.with_name(run_dir.name + "_peak")
    main = [str(REPO / "bench" / "rank_peak.py"), str(REPO / "train" / "main.py"), *args,
            "--train.run_dir", str(run_dir)]
    cmd = ([sys.executable, *main] if nproc == 1 else
           [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", _port(), *main])
    proc = subprocess.run(cmd, cwd=REPO, env=_env(peak_dir), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}")
    ranks = [json.loads((peak_dir / f"rank{r}.json").read_text()) for r in range(nproc)]
    (run_dir / "stdout.txt").write_text(proc.stdout)
    plan = json.loads((run_dir / "config.json").read_text())["resolved"].get("memory_plan") or {}
    dev = plan.get("device_bytes", {})
    banner = re.search(r"memory\s+(.*estimated peak[^\n]*)", proc.stdout)
    return {"max_rss_bytes_per_rank": [r["max_rss_bytes"] for r in ranks],
            "planned_total_bytes": dev.get("total"), "planned_params_bytes": dev.get("params"),
            "planned_activations_bytes": dev.get("activations"), "planned_model_states_bytes": dev.get("model_states"),
            "planned_buffers_bytes": dev.get("buffers"), "planned_runtime_bytes": dev.get("runtime"),
            "planned_notes": plan.get("notes"),
            "planned_option": plan.get("option"), "banner_memory": banner.group(1).strip() if banner else None}


def _ds(tmp: Path, name: str) -> Path:
    ds = json.loads((REPO / "ds_configs" / name).read_text())
    ds["bf16"] = {"enabled": False}
    out = tmp / name.replace(".json", "_fp32.json")
    out.write_text(json.dumps(ds))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--d-model", type=int, default=384)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--zero3", action="store_true", help="also 2-process ZeRO-3 with the precomputed reference")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    a = p.parse_args(argv)
    from zerotrain.train.data.make_preferences import write
    tmp = Path(tempfile.mkdtemp(prefix="bench_dpo_memory_"))
    pairs, _ = write(tmp / "pairs.jsonl", 256, 16, 0)
    model = ["--model.name", "gpt-small-cpu", "--model.d_model", str(a.d_model), "--model.n_layer", str(a.n_layer)]
    data = ["--data.kind", "preference", "--data.path", str(pairs), "--data.seq_len", str(a.seq_len),
            "--train.objective", "dpo", "--train.micro_batch_size", str(a.micro)]
    # The reference log-probs, once, with the run's model at its starting weights (train.seed), computed as
    # the runs below compute (fp32: one form under DDP and ZeRO-3).
    cfg = tmp / "run.yaml"
    cfg.write_text("train:\n  objective: dpo\n")
    t0 = time.time()
    subprocess.run([sys.executable, "-m", "zerotrain.train.cli", "prepare", "--reference", "--config", str(cfg),
                    *model, *data, "--strategy", str(_ds(tmp, "ddp.json"))], cwd=REPO, env=_env(tmp), check=True)
    prepare_s = time.time() - t0
    common = [*model, *data, "--train.max_steps", str(a.steps), "--train.eval_every", "0",
              "--train.sample_tokens", "0", "--logging.every_steps", "5", "--logging.progress", "false",
              "--logging.trackers", "jsonl", "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
              "--optim.warmup_steps", "0"]
    ddp = ["--ds-config", str(_ds(tmp, "ddp.json"))]
    variants = {
        "ddp live": (1, [*common, *ddp, "--train.dpo.reference", "live"]),
        "ddp precomputed": (1, [*common, *ddp, "--train.dpo.reference", "precomputed"]),
    }
    if a.zero3:
        variants["zero3 precomputed"] = (2, [*common, "--ds-config", str(_ds(tmp, "zero3.json")),
                                             "--train.dpo.reference", "precomputed"])
    results = {k: [] for k in variants}
    for rep in range(a.repeats):
        for name, (nproc, args) in variants.items():
            r = run(nproc, args, tmp / f"{name.replace(' ', '_')}_{rep}")
            print(name, rep, json.dumps({k: v for k, v in r.items() if k != "banner_memory"}), flush=True)
            results[name].append(r)
    mib = lambda b: b / 2 ** 20  # noqa: E731
    table = []
    for name, rs in results.items():
        nproc = variants[name][0]
        table.append({"variant": name, "processes": nproc,
                      "measured_max_rss_mib_per_rank": [mib(statistics.median(r["max_rss_bytes_per_rank"][k] for r in rs))
                                                        for k in range(nproc)],
                      "planned_total_mib": mib(rs[0]["planned_total_bytes"] or 0),
                      "planned_params_mib": mib(rs[0]["planned_params_bytes"] or 0),
                      "planned_activations_mib": mib(rs[0]["planned_activations_bytes"] or 0),
                      "planned_buffers_mib": mib(rs[0]["planned_buffers_bytes"] or 0),
                      "planned_runtime_mib": mib(rs[0]["planned_runtime_bytes"] or 0),
                      "planned_option": rs[0]["planned_option"], "banner_memory": rs[0]["banner_memory"], "runs": rs})
    stamp = time.strftime("%Y%m%d-%H%M%S")
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python bench/dpo_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "cpu_cores": os.cpu_count(), "prepare_reference_s": prepare_s,
            "load_average": os.getloadavg(), "args": vars(a) | {"out": str(a.out)}}
    (a.out / f"dpo_memory-{stamp}.json").write_text(json.dumps({"meta": meta, "results": table}, indent=1) + "\n")
    print("| variant | processes | peak RSS per rank, measured | peak per rank, planned | planned params | planned buffers (ref. copy, ZeRO-3 gathers) |")
    print("|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['variant']} | {t['processes']} | {' / '.join(f'{m:.0f}' for m in t['measured_max_rss_mib_per_rank'])} MiB"
              f" | {t['planned_total_mib']:.0f} MiB | {t['planned_params_mib']:.1f} MiB | {t['planned_buffers_mib']:.1f} MiB |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
