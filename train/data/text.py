"""Byte-level language-model data: the embedded default corpus and plain text files.

The default corpus is this Python's own standard-library source, which every machine has
without a download. Bytes are tokens (vocab 256), so no tokenizer is needed either.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.train.errors import DataError

VOCAB = 256


def default_corpus_files(directory: str | None = None) -> Iterator[Path]:
    """The standard library's *.py files (site-packages excluded) in sorted path order, so that
    every process and every run sees the same corpus. A lazy depth-first walk with each
    directory's entries sorted yields exactly `sorted(root.rglob("*.py"))` (paths compare part
    by part), but stops as soon as the reader has data.max_bytes: listing every file first
    would cost every rank of every launch (bench/import_time.py shows the difference), to read
    the first few dozen."""
    with os.scandir(directory or sysconfig.get_paths()["stdlib"]) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.is_dir(follow_symlinks=False):  # rglob does not descend into linked directories either
            if e.name != "site-packages":
                yield from default_corpus_files(e.path)
        elif e.name.endswith(".py"):
            yield Path(e.path)


def read_bytes(path: str | None, max_bytes: int, subset: str | None = None,
               split: str | None = None) -> tuple[np.ndarray, str]:
    """Concatenate text files (a file, a directory of *.txt/*.md/*.py, or the default corpus), or
    the "text" column of a table (a parquet/arrow file or glob, a save_to_disk directory, a Hub
    dataset id)."""
    if (subset is not None or split is not None) and not (path is not None and table_spec(path)):
        raise DataError(f"data.subset / data.split: data.path {path} is not a table or Hub dataset id with subsets "
                        f"and splits; remove them")
    if path is None:
        files, what = default_corpus_files(), f"Python {sysconfig.get_python_version()} standard library sources"
    elif table_spec(path):
        return table_bytes(path, max_bytes, subset, split)
    else:
        p = Path(path)
        if not p.exists():
            raise DataError(f"data.path {p} does not exist (data.kind = text expects a text file or a directory)")
        files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in (".txt", ".md", ".py", ".rst"))
        what = str(p)
    chunks, total = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 1024:
        raise DataError(f"data.path {what}: only {len(data)} bytes of text found (need at least 1 KiB)")
    return np.frombuffer(data, dtype=np.uint8), what


def table_spec(path: str) -> bool:
    """A parquet/arrow file, a glob of them or a save_to_disk directory (train/data/records.py)."""
    from zerotrain.train.data.records import JSONL_SUFFIXES, is_glob, is_table_spec
    return is_table_spec(path) and not (is_glob(path) and Path(path).suffix.lower() in JSONL_SUFFIXES)


def table_bytes(path: str, max_bytes: int, subset=None, split=None) -> tuple[np.ndarray, str]:
    """The "text" column of a `datasets` table (TRL's language-modeling format), rows joined by
    newlines as UTF-8 bytes, up to max_bytes: only the rows needed are read."""
    from zerotrain.train.data.records import open_source, table_format, table_rows
    src = open_source(path, "text", subset, split)
    if not src.is_table:
        raise DataError(f"data.path {path}: data.kind text reads a text file or directory, or a parquet/arrow "
                        f"table with a \"text\" column")
    chunks, total = [], 0
    for where, _, rec in table_rows(src.table, table_format(src.table, "text")):
        if not isinstance(rec.get("text"), str):
            raise DataError(f'{where}: "text" must be a string (got {type(rec.get("text")).__name__})')
        b = rec["text"].encode("utf-8")
        chunks.append(b)
        total += len(b) + 1
        if total >= max_bytes:
            break
    data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 1024:
        raise DataError(f"data.path {path}: only {len(data)} bytes of text found (need at least 1 KiB)")
    return np.frombuffer(data, dtype=np.uint8), f"the \"text\" column of {path}"


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


class TokenSequences(Dataset):
    """Non-overlapping windows of seq_len+1 tokens from a flat (possibly memory-mapped) array:
    input = window[:-1], labels = window[1:]. Only the window is read, never the whole file."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        w = torch.from_numpy(np.asarray(self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1], dtype=np.int64))
        return {"input_ids": w[:-1], "labels": w[1:]}
