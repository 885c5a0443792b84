"""The run's metric trackers (logging.trackers), all Accelerate GeneralTrackers, on the main
process only: metrics.jsonl (JsonlTracker, here), W&B (wandb_logger.py), TensorBoard and MLflow
(Accelerate's own, trackers.py), fanned out by Loggers. Also here: the per-interval
reduction of what every rank measured (loss, data wait, peak memory) into logged numbers.
The metric glossary is docs/observability.md.
"""

from __future__ import annotations

import json
import math
import queue
import resource
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from accelerate.tracking import GeneralTracker

from zerotrain.train import process_group


def _clean(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep them visible as strings
    return v


class JsonlTracker(GeneralTracker):
    """metrics.jsonl as an Accelerate tracker (logging.trackers "jsonl"): one JSON object per
    log call, {"step", "time", then the metrics in the order logged}; appended across resumes."""
    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a", buffering=1)

    @property
    def tracker(self):
        return self.f

    def log(self, values: dict, step: Optional[int] = None, **kwargs):
        self.f.write(json.dumps({"step": step, "time": round(time.time(), 3),
                                 **{k: _clean(v) for k, v in values.items()}}) + "\n")

    def finish(self):
        self.f.close()


class Loggers:
    """Fans every row out to the run's trackers (Accelerate GeneralTrackers); empty on non-main
    ranks. `inline` trackers (metrics.jsonl: a buffered line) are written on the caller's thread;
    the others (W&B, TensorBoard, MLflow) are called on one background writer thread, in order,
    so that a log line costs the training step none of their work (W&B's offline writer, called
    inline, slowed a small CPU model's step; with the writer thread: BENCHMARKS.md "Trainer
    overhead against the independent baseline"). A writer error is raised on
    the training thread at the next call or at close()."""

    def __init__(self, inline: list):
        self.inline, self.background = list(inline), []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: Optional[BaseException] = None
        self._writer: Optional[threading.Thread] = None

    def add(self, tracker, start=None) -> None:
        """A tracker whose calls go through the writer thread. `start`, if given, runs there first
        (MLflow keeps its active run per thread) and its error is raised here (then not added)."""
        if self._writer is None:
            self._writer = threading.Thread(target=self._drain, name="zerotrain-trackers", daemon=True)
            self._writer.start()
        if start is not None:
            self.submit(start)
            self.flush()
        self.background.append(tracker)

    def _drain(self):
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                job()
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread
                self._error = self._error or e

    def submit(self, job) -> None:
        """Run `job` on the writer thread after everything queued so far."""
        if self._error is not None:
            e, self._error = self._error, None
            raise e
        if self._writer is not None:
            self._queue.put(job)

    def log(self, metrics: dict, step: int):
        for t in self.inline:
            t.log(metrics, step=step)
        if self.background:
            row, trackers = dict(metrics), list(self.background)  # the caller may reuse its dict
            self.submit(lambda: [t.log(row, step=step) for t in trackers])

    def event(self, metrics: dict, step: int):
        """A row that marks something that happened (e.g. an elastic restart), not a measurement:
        trackers with a place for it (W&B's run summary: event()) keep it there too."""
        for t in self.inline:
            t.log(metrics, step=step)
        row, trackers = dict(metrics), list(self.background)
        self.submit(lambda: [getattr(t, "event", t.log)(row, step=step) for t in trackers])

    def flush(self):
        """Wait until every queued call has run (and raise the first error one raised)."""
        done = threading.Event()
        self.submit(done.set)
        if self._writer is not None:
            done.wait()
        self.submit(lambda: None)

    def close(self, failed: bool = False):
        """`failed`: training raised or diverged; trackers with fail() (W&B) record the run as
        failed, not finished. Drains the writer, then finishes every tracker."""
        for t in self.background:
            if failed and hasattr(t, "fail"):
                self._queue.put(t.fail)
            self._queue.put(t.finish)
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        for t in self.inline:
            t.finish()
        self.inline, self.background = [], []  # a second close() has nothing left to finish
        if self._error is not None:
            e, self._error = self._error, None
            raise e


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


def file_backed_bytes() -> int:
    """This process's resident file-backed pages (RssFile: the libraries' code and read-only
    data, shared with every process that maps them); 0 where /proc has no breakdown."""
    return _proc_status_bytes("RssFile:") or 0


def _proc_status_bytes(key: str) -> int | None:
    """A "<key> N kB" line of /proc/self/status in bytes; None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _vm_hwm() -> int:
    hwm = _proc_status_bytes("VmHWM:")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def reduce_window(acc, loss_sum: torch.Tensor, micro: int, data_s: float, positions: int = 0) -> dict:
    """Two tiny all-reduces per logging interval, combined identically on every rank:
    loss = mean over every micro-batch of every rank; `positions` (the token positions each
    rank's forwards ran on) summed over the ranks; data wait and peak memory = the worst
    rank's (the slowest or fullest rank is the one that limits the step). `loss_sum` stays on
    the device until here: this is the interval's one host read of it. The peaks then restart."""
    peak, reserved = peak_memory()
    summed = torch.stack([loss_sum.detach().to(torch.float64).reshape(()),
                          torch.tensor(float(micro), dtype=torch.float64, device=loss_sum.device),
                          torch.tensor(float(positions), dtype=torch.float64, device=loss_sum.device)]).to(acc.device)
    worst = torch.tensor([data_s, float(peak), float(reserved or 0)], dtype=torch.float64, device=acc.device)
    if acc.num_processes > 1 and process_group.exists():
        dist = torch.distributed
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    (loss, n, built), (wait, mem, res) = summed.tolist(), worst.tolist()
    reset_peak_memory()
    out = {"loss": loss / n, "data_wait_s": wait, "peak_mem_bytes": int(mem), "positions": int(built)}
    if reserved is not None:
        out["reserved_mem_bytes"] = int(res)
    return out


def read_jsonl(path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows
