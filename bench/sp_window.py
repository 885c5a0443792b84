"""Sequence parallelism with a sliding window: one rank's attention memory at long context.

After Ulysses' all-to-all a rank attends over the whole row for H/N query heads and K/N key/value
heads (models/ulysses.py hf_attention, through transformers' sdpa_attention_forward). This
measures, in a fresh process per case, the peak resident memory of one layer's attention forward
and backward there, fp32, batch 1, at T tokens:

- causal:         no window (sdpa's is_causal, no mask): what a full-attention layer runs;
- window dense:   the window as one (1, 1, T, T) banded bool mask (zerotrain before 2026-12-07);
- window blocked: models/ulysses.py windowed_sdpa (query blocks against the keys their window
                  reaches, block x (block + window) masks): what it runs now.

Peak: the process's VmHWM during forward + backward, reset through /proc/self/clear_refs once the
inputs exist, minus VmRSS at that moment (so the inputs and torch itself are not counted).

    .venv/bin/python bench/sp_window.py                       # the BENCHMARKS.md figures
    .venv/bin/python bench/sp_window.py --seq 8192 --window 1024 --heads 2 --kv-heads 1

Writes bench/results/sp_window-<timestamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 2 ** 20
CASES = ("causal", "window dense", "window blocked")


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def one(case: str, T: int, window: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """In this process: one layer's attention forward and backward; peak bytes above the inputs."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from zerotrain.models.ulysses import windowed_sdpa
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    q = torch.randn(1, heads, T, head_dim, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, T, head_dim, requires_grad=True) for _ in range(2))
    g = torch.randn(1, T, heads, head_dim)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    t0 = time.perf_counter()
    if case == "causal":
        out = sdpa_attention_forward(module, q, k, v, None, is_causal=True)[0]
    elif case == "window dense":
        pos = torch.arange(T)
        mask = ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window))[None, None]
        out = sdpa_attention_forward(module, q, k, v, mask, is_causal=False)[0]
    else:
        out = windowed_sdpa(lambda qb, kb, vb, m: sdpa_attention_forward(module, qb, kb, vb, m, is_causal=False)[0],
                            q, k, v, window)
    (out * g).sum().backward()
    seconds = time.perf_counter() - t0
    return {"case": case, "seq": T, "window": window, "peak_bytes": _status("VmHWM") - base, "seconds": seconds}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="8192,16384", help="row lengths T, comma-separated")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--heads", type=int, default=2, help="query heads on the rank (H/N)")
    p.add_argument("--kv-heads", type=int, default=1, help="key/value heads on the rank (K/N)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.one:  # the child: one case, one T
        case, T = a.one.rsplit(":", 1)
        print(json.dumps(one(case, int(T), a.window, a.heads, a.kv_heads, a.head_dim)))
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for T in (int(x) for x in a.seq.split(",")):
        for case in CASES:
            cmd = [sys.executable, __file__, "--one", f"{case}:{T}", "--window", str(a.window), "--heads",
                   str(a.heads), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
            if proc.returncode:
                rows.append({"case": case, "seq": T, "window": a.window, "error": proc.stderr.strip().splitlines()[-1]})
            else:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    import platform

    import torch
    meta = {"command": shlex.join([".venv/bin/python", "bench/sp_window.py", *(sys.argv[1:] if argv is None else argv)]),
            "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} cores", "torch": torch.__version__, "heads": a.heads, "kv_heads": a.kv_heads,
            "head_dim": a.head_dim, "threads": 1}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"sp_window-{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = [f"Command: `{meta['command']}` ({meta['date']}, {meta['machine']}, torch {meta['torch']}, 1 thread)", "",
          "| T | window | case | peak MiB above the inputs | seconds (fwd + bwd) |", "|---:|---:|---|---:|---:|"]
    for r in rows:
        md.append(f"| {r['seq']} | {r['window']} | {r['case']} | "
                  + (f"{r['peak_bytes'] / MiB:.0f} | {r['seconds']:.1f} |" if "error" not in r else f"failed: {r['error']} | |"))
    (out / f"sp_window-{stamp}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
