"""FSDP2's construction: host memory per rank while the model is built and sharded, the meta-device
build (ranks but 0 build shapes only; rank 0's values fill every rank's shards:
train/strategy/fsdp2.py FSDP2Strategy.init_context and shard) against every rank building the model
whole (what zerotrain did before, and what DDP does).

Two processes (gloo, CPU), each: the real FSDP2Strategy's init_context (or an ordinary construction
for --mode whole), a GPT of --d-model / --n-layer built in it, then fsdp2.shard (fully_shard and
the fill from rank 0). Per rank, from /proc/self/status: RSS growth over the build, RSS growth
once sharded, and the peak (VmHWM) over both, above the RSS before the build; and the fill's time.
The first meta-device construction of a process loads torch's meta kernels (a fixed cost, not the
model's): measured on its own and reported as the warm-up.

    python bench/fsdp2_build_memory.py --d-model 1024 --n-layer 12 --out bench/results

Writes <out>/fsdp2-build-memory-<timestamp>.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _rank(rank: int, world: int, mode: str, d_model: int, n_layer: int, init_file: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    from zerotrain.models import gpt
    from zerotrain.train.strategy.fsdp2 import FSDP2Strategy, setup, shard

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    cfg = gpt.GPTConfig(vocab_size=50304, seq_len=1024, d_model=d_model, n_layer=n_layer,
                        n_head=d_model // 64, n_kv_head=d_model // 64)
    strategy = FSDP2Strategy(setup("ds_configs/fsdp2.json", {"fsdp": {"reshard_after_forward": True}}, "fp32"))
    ctx = strategy.init_context() if mode == "meta" else contextlib.nullcontext
    # The first construction on the meta device loads torch's meta kernels and decompositions
    # (Python modules: a fixed cost per process, whatever the model): paid here, in both modes,
    # and reported, so that the rows compare the model's own memory.
    before = _status("VmRSS")
    with torch.device("meta"):
        gpt.GPT(gpt.GPTConfig(vocab_size=64, seq_len=8, d_model=64, n_layer=1, n_head=1, n_kv_head=1))
    warmup = _status("VmRSS") - before
    torch.manual_seed(0)
    dist.barrier()
    base = _status("VmRSS")
    with ctx():
        model = gpt.GPT(cfg)
    built = _status("VmRSS") - base
    t0 = time.perf_counter()
    shard(model, torch.device("cpu"), True, "fp32")
    fill_s = time.perf_counter() - t0
    row = {"rank": rank, "mode": mode, "params": sum(p.numel() for p in model.parameters()), "meta_warmup_bytes": warmup,
           "build_rss_bytes": built, "sharded_rss_bytes": _status("VmRSS") - base,
           "peak_rss_bytes": _status("VmHWM") - base, "shard_and_fill_s": fill_s}
    Path(out, f"{mode}-{rank}.json").write_text(json.dumps(row))
    dist.barrier()  # (no destroy_process_group: a gloo pair torn down while the other rank still
    #                  talks aborts it; the process ends here anyway)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = p.parse_args(argv)
    import torch.multiprocessing as mp
    work = Path(tempfile.mkdtemp(prefix="fsdp2-build-"))
    rows = []
    for mode in ("whole", "meta"):  # a fresh pair of processes each: VmHWM starts over
        init = work / f"{mode}.init"
        mp.start_processes(_rank, args=(2, mode, a.d_model, a.n_layer, str(init), str(work)), nprocs=2,
                           start_method="spawn")
        rows += [json.loads((work / f"{mode}-{r}.json").read_text()) for r in range(2)]
    whole_model = rows[0]["params"] * 4
    print(f"GPT d_model {a.d_model}, n_layer {a.n_layer}: {rows[0]['params'] / 1e6:.1f}M parameters, "
          f"{whole_model / MiB:.0f} MiB in fp32; growth above each rank's RSS before the build (MiB)")
    print(f"meta-device warm-up (once per process, any model): {rows[0]['meta_warmup_bytes'] / MiB:.0f} MiB")
    print(f"{'mode':6} {'rank':>4} {'build':>8} {'sharded':>8} {'peak':>8} {'shard+fill s':>13}")
    for r in rows:
        print(f"{r['mode']:6} {r['rank']:>4} {r['build_rss_bytes'] / MiB:>8.0f} {r['sharded_rss_bytes'] / MiB:>8.0f} "
              f"{r['peak_rss_bytes'] / MiB:>8.0f} {r['shard_and_fill_s']:>13.2f}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    path = Path(a.out) / f"fsdp2-build-memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"command": " ".join(["python", "bench/fsdp2_build_memory.py", *(argv or sys.argv[1:])]),
                                "machine": os.uname().nodename, "whole_model_bytes": whole_model, "rows": rows},
                               indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
