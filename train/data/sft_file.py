"""Prepared instruction data: SFT JSONL records tokenized once by `zerotrain prepare --sft`,
memory-mapped by training (data.kind sft with data.path <name>.bin) instead of every rank
tokenizing every record in Python at start-up.

Layout of data/sft.bin (all native little-endian, no headers; numpy raw + JSON, no pickles):
    sft.bin           every record's token ids, whole (seq_len is a training-time choice),
                      uint16 (vocab <= 65536) or uint32
    sft.trained.bin   uint8 0/1 per id: is the token trained (train/data/sft.py decides)
    sft.offsets.bin   int64, records + 1: record i is ids[offsets[i]:offsets[i + 1]]
    sft.index.bin     int64 (records, 2): the record's source line (for file:line errors) and
                      its first label position (>= 1; the length if none), so a record that
                      data.seq_len would truncate to no labels is found without reading tokens
    sft.json          sidecar: format, version, dtype, counts, the tokenizer (path and content
                      sha256), whether its chat template was used, and the source JSONL's path,
                      size, mtime and sha256 (a changed source makes the set stale)
    sft.val.*         the validation records, same layout (from --val or <source>.val.jsonl)

This module is the format only (write, check, map); what a record's tokens are is sft.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from zerotrain.train.errors import DataError

FORMAT = "zerotrain-sft"
VERSION = 1
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FLUSH_TOKENS = 1 << 20  # buffer ~1M tokens in lists before writing: bounded memory for any set size


def parts(out: Path) -> dict[str, Path]:
    """The files of the prepared set named by `out` (its ids file, <name>.bin)."""
    stem = out.with_suffix("")
    return {"ids": out, "trained": stem.with_name(stem.name + ".trained.bin"),
            "offsets": stem.with_name(stem.name + ".offsets.bin"), "index": stem.with_name(stem.name + ".index.bin"),
            "sidecar": out.with_suffix(".json")}


def val_path(out: Path) -> Path:
    return out.with_suffix(".val.bin")


# ----------------------------------------------------------------------------- writing

def first_label(trained) -> int:
    """Position of the first trained token that is a label (position >= 1), len(trained) if none:
    a record cut to seq_len + 1 tokens keeps a label iff this is <= seq_len (and < its length)."""
    return next((j for j in range(1, len(trained)) if trained[j]), len(trained))


def hashed_lines(f, h) -> Iterator[bytes]:
    """The lines of binary file `f`, fed to hash `h` as they are read: the source is hashed in
    the same pass that tokenizes it."""
    for line in f:
        h.update(line)
        yield line


class _Writer:
    """Streams records into temporary files; commit() renames them into place (sidecar last, as
    it is what marks a set complete), abort() removes them: no partial set is ever left."""

    def __init__(self, out: Path, vocab_size: int):
        self.dtype = np.uint16 if vocab_size <= 1 << 16 else np.uint32
        self.final = parts(out)
        self.tmp = {k: p.with_name(p.name + ".tmp") for k, p in self.final.items()}
        out.parent.mkdir(parents=True, exist_ok=True)
        self.ids_f, self.trained_f = open(self.tmp["ids"], "wb"), open(self.tmp["trained"], "wb")
        self.ids, self.trained, self.offsets, self.index = [], [], [0], []
        self.num_tokens, self.num_trained, self.max_token = 0, 0, 0

    def add(self, lineno: int, ids: list[int], trained: list[bool]):
        first = first_label(trained)
        self.ids += ids
        self.trained += trained
        self.num_tokens += len(ids)
        self.offsets.append(self.num_tokens)
        self.index.append((lineno, first))
        if len(self.ids) >= FLUSH_TOKENS:
            self._flush()

    def _flush(self):
        if self.ids:
            ids = np.asarray(self.ids, dtype=np.int64)
            self.max_token = max(self.max_token, int(ids.max()))
            ids.astype(self.dtype).tofile(self.ids_f)
            trained = np.asarray(self.trained, dtype=np.uint8)
            self.num_trained += int(trained.sum())
            trained.tofile(self.trained_f)
        self.ids, self.trained = [], []

    def commit(self, meta: dict) -> dict:
        self._flush()
        self.ids_f.close()
        self.trained_f.close()
        np.asarray(self.offsets, dtype=np.int64).tofile(self.tmp["offsets"])
        np.asarray(self.index, dtype=np.int64).reshape(-1, 2).tofile(self.tmp["index"])
        meta = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(self.dtype).name, **meta,
                "records": len(self.offsets) - 1, "num_tokens": self.num_tokens, "trained_tokens": self.num_trained,
                "max_token": self.max_token}
        self.tmp["sidecar"].write_text(json.dumps(meta, indent=1) + "\n")
        for key in ("ids", "trained", "offsets", "index", "sidecar"):
            os.replace(self.tmp[key], self.final[key])
        return meta

    def abort(self):
        self.ids_f.close()
        self.trained_f.close()
        for p in self.tmp.values():
            p.unlink(missing_ok=True)


def write(source: Path, out: Path, records: Callable[[Iterable[bytes]], Iterator[tuple[int, list, list]]],
          vocab_size: int, meta: dict, progress: Callable[[int, int], None] = lambda n, t: None) -> dict:
    """Prepare `source` (a JSONL file) into `out`: records(lines) gives (line, ids, trained) per
    record (sft.encoded_records, which raises DataError on a bad one). Returns the sidecar."""
    try:
        f = open(source, "rb")
    except OSError as e:
        raise DataError(f"prepare: cannot read {source} ({e.strerror})") from None
    h = hashlib.sha256()
    with f:
        st = os.fstat(f.fileno())
        w = _Writer(out, vocab_size)
        try:
            for lineno, ids, trained in records(hashed_lines(f, h)):
                w.add(lineno, ids, trained)
                progress(len(w.offsets) - 1, w.num_tokens)
            if len(w.offsets) == 1:
                raise DataError(f"prepare: {source} holds no records; --sft needs JSONL records")
        except BaseException:  # a bad record, Ctrl-C, a full disk: leave nothing behind
            w.abort()
            raise
    source_meta = {"path": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                   "sha256": h.hexdigest()}
    return w.commit({**meta, "source": source_meta})


# ----------------------------------------------------------------------------- reading

@dataclass
class Prepared:
    ids: np.ndarray        # memmap, num_tokens
    trained: np.ndarray    # memmap (bool view of the 0/1 bytes), num_tokens
    offsets: np.ndarray    # memmap int64, records + 1
    index: np.ndarray      # memmap int64 (records, 2): source line, first label position
    meta: dict


def read_meta(path: Path) -> dict:
    side = parts(path)["sidecar"]
    if not side.is_file():
        raise DataError(f"data.path {path}: no sidecar {side.name}; a .bin data.path for data.kind sft is a set "
                        f"made by `zerotrain prepare --sft <records.jsonl> --out {path}`")
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{side}: not valid JSON ({e}); re-run `zerotrain prepare --sft`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{side} is not a prepared instruction set (format {meta.get('format') if isinstance(meta, dict) else None!r}, "
                        f"not {FORMAT!r}); make one with `zerotrain prepare --sft <records.jsonl> --out {path}`")
    if meta.get("version") != VERSION or meta.get("dtype") not in DTYPES:
        raise DataError(f"{side}: format version {meta.get('version')} / dtype {meta.get('dtype')} is not what this "
                        f"zerotrain reads (version {VERSION}); re-run `zerotrain prepare --sft`")
    return meta


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def check_source(path: Path, meta: dict):
    """A prepared set whose source JSONL has changed since is stale. Size and mtime decide in
    O(1); only a same-size file with a new mtime is hashed. A source that is gone is not
    checked: the prepared set stands on its own (e.g. copied to a cluster without the JSONL)."""
    src = meta["source"]
    source = Path(src["path"])
    if not source.is_file():
        return
    st = source.stat()
    if st.st_size == src["size"] and st.st_mtime_ns == src["mtime_ns"]:
        return
    if st.st_size != src["size"] or _sha256(source) != src["sha256"]:
        raise DataError(f"{path} is stale: its source {source} changed after `zerotrain prepare --sft` "
                        f"({src['size']} -> {st.st_size} bytes, sha256 differs); re-run it")


def _map(path: Path, dtype, count: int, what: str, shape=None) -> np.ndarray:
    width = np.dtype(dtype).itemsize * (shape[1] if shape else 1)
    size = path.stat().st_size if path.is_file() else None
    if size != count * width:
        raise DataError(f"{path} ({what}) is {'missing' if size is None else f'{size} bytes'}, the sidecar says "
                        f"{count * width}: the set was changed after `zerotrain prepare --sft`; re-run it")
    if count == 0:
        return np.zeros(shape or (0,), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape or (count,))


def read(path: Path) -> Prepared:
    """The checked, memory-mapped set named by `path`: nothing but the index is read here."""
    meta = read_meta(path)
    check_source(path, meta)
    p, n, r = parts(path), meta["num_tokens"], meta["records"]
    return Prepared(ids=_map(p["ids"], DTYPES[meta["dtype"]], n, "token ids"),
                    trained=_map(p["trained"], np.bool_, n, "trained flags"),
                    offsets=_map(p["offsets"], np.int64, r + 1, "record offsets"),
                    index=_map(p["index"], np.int64, r, "record index", shape=(r, 2)), meta=meta)
