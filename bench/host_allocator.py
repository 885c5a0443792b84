"""What the host allocator settings cost and save on a CPU: peak memory per rank (the rank's
memory cgroup peak, bench/memcap.py) and step time, for glibc's default allocator and zerotrain's
compact setting (hardware.host_malloc), each with and without transparent huge pages for large
tensors (THP_MEM_ALLOC_ENABLE, which train/main.py sets to 1 unless the environment says).

    python bench/host_allocator.py                  # the BENCHMARKS.md table (~8 min)
    python bench/host_allocator.py --configs zero3 --d-model 768 --n-layer 8

Writes bench/results/allocator-<timestamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import family, launch, trainer_args  # noqa: E402
from stages import REPO, machine  # noqa: E402

GiB = 2 ** 30
SETTINGS = (("glibc", "0"), ("compact", "0"), ("glibc", "1"), ("compact", "1"))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="ddp,zero2,zero3")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = Path(a.out)
    tmp = out_dir / f"tmp-allocator-{stamp}"
    fam = family("fp32", tmp / "configs")
    rows = []
    for name in [n.strip() for n in a.configs.split(",") if n.strip()]:
        for malloc, thp in SETTINGS:
            print(f"[allocator] {name}: host_malloc {malloc}, THP_MEM_ALLOC_ENABLE={thp} ...", flush=True)
            r = launch(a, [*trainer_args(a), "--ds-config", str(fam / f"{name}.json"), "--hardware.host_malloc", malloc],
                       tmp / f"{name}-{malloc}-thp{thp}", None, env_extra={"THP_MEM_ALLOC_ENABLE": thp})
            metrics = [json.loads(x) for x in (tmp / f"{name}-{malloc}-thp{thp}" / "run" / "metrics.jsonl")
                       .read_text().splitlines() if x.strip()] if r["rc"] == 0 else []
            steps = [m["step_time_s"] for m in metrics if "step_time_s" in m][2:]  # after two warm-up steps
            rows.append({"config": name, "host_malloc": malloc, "thp": thp, **r,
                         "step_time_s": statistics.median(steps) if steps else None})
    meta = {"command": shlex.join([Path(sys.executable).name, "bench/host_allocator.py",
                                   *(sys.argv[1:] if argv is None else argv)]), "machine": machine(),
            "model": f"gpt-small-cpu d_model={a.d_model} n_layer={a.n_layer} seq={a.seq_len} micro={a.micro_batch}, "
                     f"fp32", "nproc": a.nproc, "started": stamp}
    (out_dir / f"allocator-{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = [f"Command: `{meta['command']}`  ", f"Machine: {meta['machine'].get('cpu')} ({meta['machine'].get('cpu_cores')} "
          f"cores), torch {meta['machine'].get('torch')}  ", f"Model: {meta['model']}, {a.nproc} processes, "
          f"{a.steps} steps (median step time after 2)", "",
          "| config | host_malloc | huge pages | peak GiB per rank (cgroup) | max RSS GiB per rank | step time s |",
          "|---|---|---|---|---|---:|"]
    for r in rows:
        md.append(f"| {r['config']} | {r['host_malloc']} | {'on' if r['thp'] == '1' else 'off'} | "
                  f"{' / '.join(f'{p / GiB:.2f}' for p in r['peak_bytes_per_rank'])} | "
                  f"{' / '.join(f'{p / GiB:.2f}' for p in r['max_rss_bytes_per_rank'])} | "
                  f"{r['step_time_s']:.2f} |" if r["step_time_s"] else f"| {r['config']} | ... failed |")
    text = "\n".join(md) + "\n"
    (out_dir / f"allocator-{stamp}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
