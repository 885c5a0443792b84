"""Sharded token datasets: a directory of flat token files plus one manifest.

Layout (written by `zerotrain prepare ... --out DIR`, see train/data/prepare_pool.py):
    DIR/manifest.json     {"format": "zerotrain-shards", "version", "dtype", "vocab_size", "tokenizer",
                           "num_tokens", "max_token", "checksum": "sha256",
                           "shards": [{"file", "num_tokens", "max_token", "bytes", "sha256"}, ...],
                           "val": [...same, the --val split...]}
    DIR/shard_00000.bin   training tokens, native little-endian uint16/uint32, no header
    DIR/val_00000.bin     validation tokens (when prepare had --val)

Opening costs O(1) per shard and no reads: the manifest is parsed and each shard's size is
checked with one stat (measured: BENCHMARKS.md "Sharded token sets: opening 1,000 shards").
A shard is opened only when a sample from it is first read, so each rank (and each DataLoader
worker) opens only the shards its samples live in. Checksums are NOT verified at open (hashing
10 GB at every start is not acceptable): `zerotrain prepare --verify DIR` hashes every shard once.

Reads are one pread per sample, not a memory map: every page a map has touched counts in the
process's RSS until the kernel reclaims it, so a mapped corpus's RSS grows with every sample
read (readahead + fault-around), with the steps run, up to the corpus size per rank (measured:
BENCHMARKS.md "Data at pre-training scale", bench/read_rss.py). pread leaves those pages in the
shared page cache, outside any process's RSS, so a rank's peak RSS does not depend on the corpus size or the run length (bench/data_scale.py,
BENCHMARKS.md). At most MAX_OPEN shard files are held open per process (least recently used
closed first), so a corpus of thousands of shards stays under the file-descriptor limit.
Descriptors are never pickled (spawned DataLoader workers open their own); forked workers
inherit the parent's, which pread shares safely (no file position involved).

Samples: each shard (or a part of one, see the val split) is cut into windows of
seq_len+1 tokens with stride seq_len exactly like a single token file (train/data/text.py
TokenSequences); windows never cross a shard boundary and a shard's tail shorter than a
window is dropped (counted in `describe`). Global index -> (segment, window) is one
np.searchsorted over the cumulative window counts.

Validation: the manifest's `val` shards when there are any, else the last
data.val_fraction of all tokens (as for a single file: whole trailing shards plus the tail of
one), so a one-shard corpus gives exactly the samples of the equivalent .bin file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.train.errors import DataError

FORMAT = "zerotrain-shards"
VERSION = 1
MANIFEST = "manifest.json"
CHECKSUM = "sha256"
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
REPREPARE = "re-run zerotrain prepare"
MAX_OPEN = 64  # shard files held open per process (LRU)


def is_sharded(path: Path) -> bool:
    """data.path names a shard directory or its manifest (anything else is a single token file)."""
    return path.is_dir() or path.name == MANIFEST


def hasher():
    # sha256 over blake2b: faster on a CPU with SHA extensions (measured: BENCHMARKS.md "Sharded
    # token sets: opening 1,000 shards"), and `sha256sum DIR/shard_00000.bin` checks a shard by hand.
    return hashlib.sha256()


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    h = hasher()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class Corpus:
    """A parsed manifest: shard names, sizes and ids; maps shards lazily, one memmap each."""

    def __init__(self, path: Path, token_dtype: Optional[str] = None):
        self.dir = path.parent if path.name == MANIFEST else path
        self.manifest = self.dir / MANIFEST
        if not self.manifest.is_file():
            raise DataError(f"data.path {self.dir}: no {MANIFEST} (a shard directory is written by "
                            f"`zerotrain prepare <inputs> --out {self.dir}`; if it was interrupted, re-run it to finish)")
        try:
            meta = json.loads(self.manifest.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{self.manifest}: not valid JSON ({e}); {REPREPARE}") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES \
                or not isinstance(meta.get("shards"), list) or not meta["shards"]:
            raise DataError(f"{self.manifest} is not a zerotrain shard manifest (needs format={FORMAT!r}, dtype "
                            f"uint16/uint32 and a non-empty shards list); {REPREPARE}")
        if meta.get("version") != VERSION:
            raise DataError(f"{self.manifest}: manifest version {meta.get('version')} (this zerotrain reads "
                            f"{VERSION}); {REPREPARE}")
        if token_dtype and token_dtype != meta["dtype"]:
            raise DataError(f"data.token_dtype {token_dtype} contradicts {self.manifest} (dtype {meta['dtype']}); "
                            f"drop data.token_dtype")
        self.meta, self.dtype = meta, meta["dtype"]
        self.width = np.dtype(DTYPES[self.dtype]).itemsize
        self.shards = list(meta["shards"]) + list(meta.get("val") or [])
        self.num_train = len(meta["shards"])
        try:
            self.sizes = np.array([int(s["num_tokens"]) for s in self.shards], dtype=np.int64)
            self.max_token = max(int(s["max_token"]) for s in self.shards)
            names = [str(s["file"]) for s in self.shards]
        except (KeyError, TypeError, ValueError) as e:
            raise DataError(f"{self.manifest}: a shard entry lacks file/num_tokens/max_token ({e}); {REPREPARE}") \
                from None
        # One stat per shard (no open, no read): a truncated or missing shard fails here, in
        # milliseconds, instead of as a bus error in a DataLoader worker hours later.
        for name, n in zip(names, self.sizes):
            p = self.dir / name
            try:
                size = os.stat(p).st_size
            except OSError:
                raise DataError(f"{p}: missing (listed in {self.manifest}); {REPREPARE}") from None
            if size != n * self.width:
                raise DataError(f"{p}: {size} bytes, the manifest says {n * self.width} ({n} {self.dtype} tokens); "
                                f"{REPREPARE}")
        self.paths = [self.dir / n for n in names]
        self.vocab_size = meta.get("vocab_size")
        self._fds: dict[int, int] = {}  # shard -> open descriptor, least recently used first

    def read(self, shard: int, start: int, count: int) -> np.ndarray:
        """`count` tokens of `shard` from token `start`: one pread (the shard opened on first use)."""
        fd = self._fds.pop(shard, None)
        if fd is None:
            if len(self._fds) >= MAX_OPEN:
                os.close(self._fds.pop(next(iter(self._fds))))
            fd = os.open(self.paths[shard], os.O_RDONLY)
        self._fds[shard] = fd  # now the most recently used
        want = count * self.width
        b = os.pread(fd, want, start * self.width)
        if len(b) != want:
            raise DataError(f"{self.paths[shard]}: short read at token {start} (the file shrank after the run "
                            f"started); {REPREPARE}")
        return np.frombuffer(b, dtype=DTYPES[self.dtype])

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __del__(self):
        try:
            self.close()
        except (OSError, AttributeError, TypeError):  # interpreter shutdown
            pass

    def __getstate__(self):
        # Descriptors are per process: a pickled copy (a spawned worker) opens its own.
        return {**self.__dict__, "_fds": {}}

    def verify(self, progress=lambda name: None) -> int:
        """Hash every shard against the manifest (the explicit, slow check); returns the bytes read."""
        total = 0
        for entry, path in zip(self.shards, self.paths):
            progress(path.name)
            want = entry.get("sha256")
            if want is None:
                raise DataError(f"{path}: no sha256 checksum in {self.manifest}; {REPREPARE}")
            if file_digest(path) != want:
                raise DataError(f"{path}: checksum mismatch (sha256 differs from {self.manifest}); {REPREPARE}")
            total += path.stat().st_size
        return total


class ShardSequences(Dataset):
    """Windows of seq_len+1 tokens over segments (shard, start, stop) of a Corpus; the same
    samples TokenSequences gives for each segment on its own, one after the other."""

    def __init__(self, corpus: Corpus, segments: list[tuple[int, int, int]], seq_len: int):
        self.corpus, self.seq_len = corpus, seq_len
        self.segments = np.array(segments, dtype=np.int64).reshape(-1, 3)
        lengths = self.segments[:, 2] - self.segments[:, 1]
        counts = np.maximum((lengths - 1) // seq_len, 0)
        self.ends = np.cumsum(counts)  # ends[k] = windows in segments 0..k
        self.n = int(self.ends[-1]) if len(counts) else 0
        self.tokens_used = int((counts * seq_len + (counts > 0)).sum())
        self.dropped = int(lengths.sum()) - self.tokens_used  # shard tails shorter than a window

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        k = int(np.searchsorted(self.ends, i, side="right"))
        w = i - (int(self.ends[k - 1]) if k else 0)
        shard, start, _ = (int(x) for x in self.segments[k])
        lo = start + w * self.seq_len
        window = self.corpus.read(shard, lo, self.seq_len + 1)
        t = torch.from_numpy(window.astype(np.int64))
        return {"input_ids": t[:-1], "labels": t[1:]}


def split(corpus: Corpus, val_fraction: float, seq_len: int):
    """(train segments, val segments or None, how the split was made)."""
    train = [(i, 0, int(corpus.sizes[i])) for i in range(corpus.num_train)]
    if len(corpus.shards) > corpus.num_train:
        return train, [(i, 0, int(corpus.sizes[i])) for i in range(corpus.num_train, len(corpus.shards))], \
            f"val: {len(corpus.shards) - corpus.num_train} val shards"
    total = int(corpus.sizes[:corpus.num_train].sum())
    n_val = int(total * val_fraction)
    if val_fraction <= 0 or n_val <= seq_len + 1:  # as a single token file: too small a tail is no split
        return train, None, "no validation"
    cut, val = total - n_val, []
    offset = 0
    kept = []
    for shard, _, n in train:
        if offset + n <= cut:
            kept.append((shard, 0, n))
        elif offset >= cut:
            val.append((shard, 0, n))
        else:
            kept.append((shard, 0, cut - offset))
            val.append((shard, cut - offset, n))
        offset += n
    return kept, val, f"val: last {val_fraction:.0%}"


def build_shards(path: Path, token_dtype: Optional[str], val_fraction: float, seq_len: int):
    """The DataBundle for a shard directory (train/data/tokens.py build_tokens calls this)."""
    from zerotrain.train.data.bundle import DataBundle
    from zerotrain.train.data.text import decode
    corpus = Corpus(path, token_dtype)
    train_segs, val_segs, how = split(corpus, val_fraction, seq_len)
    train = ShardSequences(corpus, train_segs, seq_len)
    if len(train) == 0:
        raise DataError(f"{corpus.dir}: {int(corpus.sizes[:corpus.num_train].sum())} training tokens in "
                        f"{corpus.num_train} shards make no sequence of data.seq_len {seq_len}+1; use more data or a "
                        f"shorter data.seq_len")
    val = ShardSequences(corpus, val_segs, seq_len) if val_segs else None
    dropped = train.dropped + (val.dropped if val else 0)
    n_tok = int(corpus.sizes.sum())
    return DataBundle(
        train=train, val=val, task="lm", items_per_sample=seq_len, seq_len=seq_len,
        vocab_size=corpus.vocab_size or corpus.max_token + 1,
        decode=decode if corpus.meta.get("tokenizer") == "bytes" else None,
        describe=f"token shards {corpus.dir} ({len(corpus.shards)} shards, {n_tok / 1e6:.2f}M {corpus.dtype} tokens, "
                 f"{len(train)} sequences of {seq_len}; {dropped} tokens of shard tails shorter than a window "
                 f"dropped; {how})",
        extra={"max_token": corpus.max_token, "token_file": str(corpus.dir), "tokenizer": corpus.meta.get("tokenizer"),
               "dropped_tokens": dropped})
