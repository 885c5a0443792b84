"""checkpoint.async: the host snapshot of a save and its write in the background.

A save with checkpoint.async copies this rank's part of the state (the same pieces a synchronous
save writes) into `Staging`, host buffers allocated at the first save and reused by every later
one, then hands them to a `BackgroundWrite`: a thread that writes the same files a synchronous
save writes (same names, same bytes), fsyncs them and writes the rank's part list, while the loop
trains on. Committing (manifest, rename, `latest`) is rank 0's, once every rank's write is known
to be durable: train/checkpoint/async_save.py (`poll`, `flush`), docs/checkpoints.md.

A thread, not a process: the snapshot is already in this process's memory, and the write
(safetensors' serialisation, the file writes, fsync, sha256) runs outside the GIL, so the thread
costs the loop little; a process would need the snapshot copied again (or placed in shared
memory) and could not be forked safely from a process holding CUDA and NCCL state.

On CUDA the buffers are pinned and the copies run on a side stream that first waits for the
step's work; the loop's stream then waits (on the device, not the host) for the copies before
its next kernels, and the writer thread waits for the copy event before it reads the buffers.
"""

from __future__ import annotations

import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch


class Staging:
    """Host buffers for one rank's snapshot, by piece key, reused across saves."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.bufs: dict[str, torch.Tensor] = {}
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.event = None

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())

    def begin(self) -> None:
        if self.cuda:  # the copies read what the step's kernels wrote
            self.stream.wait_stream(torch.cuda.current_stream())

    def copy(self, key: str, src: Optional[torch.Tensor], numel: int, dtype=torch.float32) -> torch.Tensor:
        """This piece in its reused host buffer (zeros for a moment not created yet)."""
        buf = self.bufs.get(key)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, pin_memory=self.cuda)
            self.bufs[key] = buf
        if src is None:
            buf.zero_()
        elif self.cuda and src.is_cuda:
            with torch.cuda.stream(self.stream):
                buf.copy_(src.detach().reshape(-1), non_blocking=True)
        else:
            buf.copy_(src.detach().reshape(-1))
        return buf

    def end(self) -> None:
        if self.cuda:  # the next step's kernels may overwrite the sources only once copied
            self.event = torch.cuda.Event()
            self.event.record(self.stream)
            torch.cuda.current_stream().wait_event(self.event)

    def ready(self) -> None:
        """In the writer thread: the copies have landed."""
        if self.event is not None:
            self.event.synchronize()


@dataclass(eq=False)
class BackgroundWrite:
    """One rank's write of one save, in a thread. `records` (file -> size, sha256) when it
    succeeded, `error` when it failed; `status()` is this rank's part of the loop's vote."""

    seq: int                    # the save's number in this run: the same on every rank
    step: int
    tmp: Path
    final: Path
    blocked_s: float            # what the loop spent on it: waiting for the previous write, agreeing, copying
    waited_s: float             # of which waiting for the previous save's write
    work: Callable[["BackgroundWrite"], dict]
    disk_full: Callable[[BaseException], bool]
    records: Optional[dict] = None
    error: Optional[BaseException] = None
    trace: str = ""
    write_s: float = 0.0
    waiting: threading.Event = field(default_factory=threading.Event)  # the loop waits for it (test hooks)
    thread: Optional[threading.Thread] = None

    def start(self) -> "BackgroundWrite":
        # Not a daemon: the interpreter does not exit (e.g. after an error) in the middle of a write.
        self.thread = threading.Thread(target=self._run, name=f"zerotrain-checkpoint-{self.step}", daemon=False)
        self.thread.start()
        return self

    def _run(self):
        t0 = time.perf_counter()
        try:
            self.records = self.work(self)
        except BaseException as e:  # noqa: BLE001 - reported when every rank's outcome is known
            self.error = e
            self.trace = traceback.format_exc()
        self.write_s = time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def wait(self) -> float:
        """Block until written; the seconds waited."""
        if self.thread is None or self.done:
            return 0.0
        t0 = time.perf_counter()
        self.waiting.set()
        self.thread.join()
        return time.perf_counter() - t0

    def status(self) -> tuple[float, float, float, float]:
        """(save number, written, failed, failed for a full disk): summed over the ranks by the vote."""
        if not self.done:
            return float(self.seq), 0.0, 0.0, 0.0
        failed = self.error is not None
        return float(self.seq), float(not failed), float(failed), float(failed and self.disk_full(self.error))
