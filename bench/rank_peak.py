"""Run a Python script as __main__ and, when it exits, write this rank's peak memory to
$ZT_PEAK_DIR/rank<RANK>.json: torch.cuda.max_memory_allocated() on a GPU, else the
process's max RSS; plus a trace of (wall clock, process CPU seconds) sampled every 50 ms,
from which bench/stages.py gets the CPU time of each timed window (throughput per CPU
second is far less disturbed than wall time by other load on a shared machine). Lets the
benchmark measure the trainer and the minimal loop alike without either of them knowing.

    torchrun --nproc_per_node 2 bench/rank_peak.py train/main.py --ds-config ...
"""

import atexit
import json
import os
import resource
import runpy
import sys
import threading
import time
from pathlib import Path

_TRACE: list = []       # [wall clock s, process CPU s]
_STOP = threading.Event()


def _sample(every: float = 0.05):
    while not _STOP.is_set():
        _TRACE.append((round(time.time(), 4), round(time.process_time(), 4)))
        _STOP.wait(every)


def _dump():
    _STOP.set()
    out = os.environ.get("ZT_PEAK_DIR")
    if not out:
        return
    _TRACE.append((round(time.time(), 4), round(time.process_time(), 4)))
    info = {"rank": int(os.environ.get("RANK", 0)),
            "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    try:
        import torch
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            info["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
            info["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    except ImportError:
        pass
    # The trainer restarts the peak statistics at every log line (train/observe/metrics.py) and keeps
    # the largest it saw: the run's peak.
    metrics = sys.modules.get("zerotrain.train.observe.metrics")
    if metrics is not None:
        peak, reserved = metrics.lifetime_peaks()
        if "cuda_max_allocated_bytes" in info:
            info["cuda_max_allocated_bytes"] = max(info["cuda_max_allocated_bytes"], peak)
            info["cuda_max_reserved_bytes"] = max(info["cuda_max_reserved_bytes"], reserved or 0)
        else:
            info["max_rss_bytes"] = max(info["max_rss_bytes"], peak)
    info["peak_bytes"] = info.get("cuda_max_allocated_bytes", info["max_rss_bytes"])
    info["cpu_trace"] = _TRACE
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{info['rank']}.json").write_text(json.dumps(info) + "\n")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: rank_peak.py SCRIPT [ARGS...]")
    atexit.register(_dump)
    threading.Thread(target=_sample, daemon=True).start()
    # The deepspeed launcher puts --local_rank=N first: it belongs to SCRIPT, after its own args.
    local = [x for x in sys.argv[1:] if x.startswith("--local_rank=")]
    rest = [x for x in sys.argv[1:] if not x.startswith("--local_rank=")]
    script = rest[0]
    sys.argv = rest + local
    sys.path[0] = str(Path(script).resolve().parent)  # as if SCRIPT had been run directly
    runpy.run_path(script, run_name="__main__")
