"""Metric sinks behind one interface: log(metrics, step) / close(). Main process only.

metrics.jsonl is always written so nothing depends on W&B; W&B goes through Accelerate's
tracker API and is imported lazily (see wandb_logger.py). Also here: the per-interval
reduction of what every rank measured (loss, data wait, peak memory) into logged numbers.
The metric glossary is docs/observability.md.
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path

import torch


def _clean(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep them visible as strings
    return v


class JsonlLogger:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a", buffering=1)

    def log(self, metrics: dict, step: int):
        self.f.write(json.dumps({"step": step, "time": round(time.time(), 3),
                                 **{k: _clean(v) for k, v in metrics.items()}}) + "\n")

    def close(self, failed: bool = False):
        self.f.close()


class Loggers:
    """Fans out to every sink; a no-op on non-main ranks (they hold no sinks)."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, metrics: dict, step: int):
        for s in self.sinks:
            s.log(metrics, step)

    def close(self, failed: bool = False):
        """`failed`: training raised or diverged; W&B then records the run as failed, not finished."""
        for s in self.sinks:
            s.close(failed=failed)


def peak_memory_bytes() -> int:
    """This rank's peak: CUDA memory allocated by tensors on GPU, the process's max RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reduce_window(acc, loss_sum, micro: int, data_s: float) -> dict:
    """Two tiny all-reduces per logging interval, combined identically on every rank:
    loss = mean over every micro-batch of every rank; data wait and peak memory = the worst
    rank's (the slowest or fullest rank is the one that limits the step)."""
    summed = torch.tensor([float(loss_sum), float(micro)], dtype=torch.float64, device=acc.device)
    worst = torch.tensor([data_s, float(peak_memory_bytes())], dtype=torch.float64, device=acc.device)
    dist = torch.distributed
    if acc.num_processes > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    (loss, n), (wait, mem) = summed.tolist(), worst.tolist()
    return {"loss": loss / n, "data_wait_s": wait, "peak_mem_bytes": int(mem)}


def read_jsonl(path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows
