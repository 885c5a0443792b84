"""One process, no launcher: the resident memory one forward + backward of models/gpt.py adds, next
to the planner's activation bytes (train/plan/activations.py). It separates what the activations
are from what the allocator keeps: run it as is (glibc's default) and with
MALLOC_MMAP_THRESHOLD_=131072 (freed large blocks go back to the OS at once).

    python bench/activation_rss.py --seq-len 2048 4096 8192
    MALLOC_MMAP_THRESHOLD_=131072 python bench/activation_rss.py --seq-len 4096 8192

Each length runs in its own process (peak RSS is per process). Model: gpt-small-cpu at
d_model 256 (4 heads, 2 KV heads), fp32, activation checkpointing on by default, 1 torch thread.
Prints one JSON line per length (MiB)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 2 ** 20


def measure(T: int, d_model: int, checkpointing: bool) -> dict:
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(REPO))
    from zerotrain.models.gpt import GPT, PRESETS
    from zerotrain.train.plan.activations import activation_bytes
    from zerotrain.train.plan.shapes import BatchShape
    torch.set_num_threads(1)
    cfg = dataclasses.replace(PRESETS["gpt-small-cpu"], d_model=d_model, seq_len=T,
                              activation_checkpointing=checkpointing)
    model = GPT(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (1, T))
    model(idx[:, :16]).float().sum().backward()  # gradients allocated, kernels loaded
    before = int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
    logits = model(idx)
    F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1)).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    planned = activation_bytes(cfg, BatchShape(1, T, checkpointing=checkpointing), 4)
    return {"seq_len": T, "checkpointing": checkpointing, "resident_growth_MiB": round((peak - before) / MiB, 1),
            "planner_activations_MiB": round(planned / MiB, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--no-checkpointing", action="store_true")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: measure one length
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.seq_len[0], a.d_model, not a.no_checkpointing)), flush=True)
        return 0
    for T in a.seq_len:
        cmd = [sys.executable, __file__, "--one", "--seq-len", str(T), "--d-model", str(a.d_model)]
        subprocess.run(cmd + (["--no-checkpointing"] if a.no_checkpointing else []), check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
