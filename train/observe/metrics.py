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

from zerotrain.train import process_group


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

    def event(self, metrics: dict, step: int):
        """A row that marks something that happened (e.g. an elastic restart), not a measurement:
        sinks with a place for it (W&B's run summary) keep it there too."""
        for s in self.sinks:
            getattr(s, "event", s.log)(metrics, step)

    def close(self, failed: bool = False):
        """`failed`: training raised or diverged; W&B then records the run as failed, not finished."""
        for s in self.sinks:
            s.close(failed=failed)


_lifetime = [0, 0]  # the largest interval peak and peak reserved read so far (a reset forgets them)


def peak_memory() -> tuple[int, int | None]:
    """This rank's (peak, peak reserved) since the last reset_peak_memory(): CUDA memory
    allocated by tensors and held by the caching allocator on GPU; the process's peak RSS
    (VmHWM) on CPU, where nothing is reserved beyond it."""
    if torch.cuda.is_available():
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    else:
        peak, reserved = _vm_hwm(), None
    _lifetime[0], _lifetime[1] = max(_lifetime[0], peak), max(_lifetime[1], reserved or 0)
    return peak, reserved


def reset_peak_memory() -> None:
    """Start a new interval: torch's peak statistics on CUDA; on Linux CPU, writing 5 to
    /proc/self/clear_refs resets the peak RSS (a kernel without it keeps the process's peak)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def lifetime_peaks() -> tuple[int, int]:
    """The largest (peak, reserved) any interval saw, for wrappers that want the whole run's
    (bench/rank_peak.py)."""
    peak_memory()
    return _lifetime[0], _lifetime[1]


def _vm_hwm() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reduce_window(acc, loss_sum: torch.Tensor, micro: int, data_s: float) -> dict:
    """Two tiny all-reduces per logging interval, combined identically on every rank:
    loss = mean over every micro-batch of every rank; data wait and peak memory = the worst
    rank's (the slowest or fullest rank is the one that limits the step). `loss_sum` stays on
    the device until here: this is the interval's one host read of it. The peaks then restart."""
    peak, reserved = peak_memory()
    summed = torch.stack([loss_sum.detach().to(torch.float64).reshape(()),
                          torch.tensor(float(micro), dtype=torch.float64, device=loss_sum.device)]).to(acc.device)
    worst = torch.tensor([data_s, float(peak), float(reserved or 0)], dtype=torch.float64, device=acc.device)
    if acc.num_processes > 1 and process_group.exists():
        dist = torch.distributed
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    (loss, n), (wait, mem, res) = summed.tolist(), worst.tolist()
    reset_peak_memory()
    out = {"loss": loss / n, "data_wait_s": wait, "peak_mem_bytes": int(mem)}
    if reserved is not None:
        out["reserved_mem_bytes"] = int(res)
    return out


def read_jsonl(path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows
