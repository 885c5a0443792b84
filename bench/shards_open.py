"""Opening a sharded token set: build_data on a manifest of N tiny shards (default 1,000).

Opening reads the manifest and stats each shard (no open, no map); a shard is opened when a
sample from it is first read. Also times one sample read (opens one shard) and the sha256 vs
blake2b hashing rate that --verify pays (why sha256).

    .venv/bin/python bench/shards_open.py [N=1000]
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO)]

from zerotrain.train.config import DataConfig  # noqa: E402
from zerotrain.train.data import build_data  # noqa: E402
from zerotrain.train.data.shards import FORMAT, MANIFEST, VERSION, file_digest  # noqa: E402


def make(d: Path, n: int, tokens: int = 4096) -> None:
    rng = np.random.default_rng(0)
    shards = []
    for i in range(n):
        ids = rng.integers(0, 256, tokens, dtype=np.uint16)
        name = f"shard_{i:05d}.bin"
        ids.tofile(d / name)
        shards.append({"file": name, "num_tokens": tokens, "max_token": int(ids.max()), "bytes": 2 * tokens,
                       "sha256": file_digest(d / name)})
    (d / MANIFEST).write_text(json.dumps({"format": FORMAT, "version": VERSION, "dtype": "uint16", "vocab_size": 256,
                                          "tokenizer": "bytes", "checksum": "sha256", "shards": shards}))


def hash_rate(name: str, mb: int = 256) -> float:
    buf = np.random.default_rng(1).integers(0, 255, mb << 20, dtype=np.uint8).tobytes()
    h = hashlib.blake2b(digest_size=32) if name == "blake2b" else hashlib.sha256()
    t0 = time.perf_counter()
    h.update(buf)
    return mb / (time.perf_counter() - t0)


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        make(d, n)
        cfg = DataConfig(kind="tokens", path=str(d), val_fraction=0.0)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            bundle = build_data(cfg, 128, 0)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bundle.train[len(bundle.train) // 2]
        first = time.perf_counter() - t0
        print(f"{n} shards, {len(bundle.train)} sequences: build_data {min(times) * 1e3:.1f} ms (best of 5, "
              f"median {sorted(times)[2] * 1e3:.1f} ms); first sample read (opens 1 shard) {first * 1e3:.2f} ms; "
              f"shards opened: {len(bundle.train.corpus._fds)}")
    print(f"hashing (--verify): blake2b {hash_rate('blake2b'):.0f} MB/s, sha256 {hash_rate('sha256'):.0f} MB/s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1000)
