"""Why shards are read by pread, not a memory map: RSS and time per random window read.

Writes a file of random uint16 tokens (default 1 GiB) in a temp dir, drops it from the page
cache (posix_fadvise DONTNEED), then reads N random windows of 129 tokens (one training
sample of the default GPT) in a fresh process per method, and prints the process's RSS growth
(RssFile: pages of the file mapped into the process) and the mean time per window, cold.

    .venv/bin/python bench/read_rss.py [--gib 1] [--samples 4800]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WINDOW = 129


def rss() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssFile", "RssAnon"):
                out[key] = int(line.split()[1]) * 1024
    return out


def child(path: str, method: str, samples: int) -> None:
    import numpy as np
    n = os.path.getsize(path) // 2
    starts = np.random.default_rng(1).integers(0, n - WINDOW, size=samples)
    before = rss()
    t0 = time.perf_counter()
    if method == "mmap":
        m = np.memmap(path, dtype=np.uint16, mode="r")
        for s in starts:
            np.asarray(m[s:s + WINDOW], dtype=np.int64)
    else:
        fd = os.open(path, os.O_RDONLY)
        for s in starts:
            np.frombuffer(os.pread(fd, 2 * WINDOW, 2 * int(s)), dtype=np.uint16).astype(np.int64)
    per = (time.perf_counter() - t0) / samples
    after = rss()
    print(f"{method:5s}: {per * 1e6:6.0f} us/window cold; RSS +{(after['VmRSS'] - before['VmRSS']) / 2**20:6.1f} MiB "
          f"(RssFile +{(after['RssFile'] - before['RssFile']) / 2**20:.1f} MiB) after {samples} windows", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--samples", type=int, default=4800, help="e.g. 150 steps x 2 ranks x micro 16")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.samples)
    import numpy as np
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent / "results") as tmp:
        path = Path(tmp) / "tokens.bin"
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for _ in range(int(a.gib * 2 ** 30) // (2 ** 26)):
                rng.integers(0, 256, size=2 ** 25, dtype=np.uint16).tofile(f)
        for method in ("mmap", "pread"):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            subprocess.run([sys.executable, __file__, "--samples", str(a.samples), "--child", str(path), method],
                           check=True)


if __name__ == "__main__":
    main()
