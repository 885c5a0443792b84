"""Streaming tokenization: train straight from local parquet / arrow / jsonl files (data.kind
stream), tokenized on the fly by a worker pool, no `zerotrain prepare` step.

The stream. data.path is a file or a directory (`prep_sources.find_input_files`, as prepare
finds them). Each file is cut into chunks: parquet and arrow files by rows, CHUNK_ROWS or
fewer so that a chunk holds about CHUNK_BYTES of text (row counts and column sizes are in the
parquet footer / the memory-mapped arrow table: no scan), JSON lines by CHUNK_BYTES byte ranges (a record belongs to the range its line starts in: no scan either).
Pass p visits every file once, in a seeded permutation of the files (seed, p), each file's
chunks in order (parquet decodes sequentially). The passes follow each other without end:
chunk K of the stream is chunk K mod N of pass K div N (N chunks per pass). A chunk's
documents are its records' data.text_field; each is tokenized with the run's tokenizer
(bytes, or a local Hugging Face tokenizer, as `zerotrain prepare`) and followed by the
tokenizer's separator (newline for bytes, EOS otherwise). The token stream is the
concatenation of every chunk's tokens; window w is tokens [w T, w T + T + 1) (T = seq_len:
inputs and shifted labels, stride T, windows cross document, chunk, file and pass
boundaries, nothing is padded or dropped). So the tokens are exactly a tokenization of the
documents concatenated with separators, in pass order (tests/test_stream.py checks that).

Validation: a document is held out when crc32(file name relative to data.path, record id) /
2^32 < data.val_fraction (record id: row number, or byte offset of a JSON line): a fixed,
seed-independent 5 % by default that training never sees; the validation set is the first
VAL_WINDOWS windows of the held-out documents in file order (read and tokenized at start-up;
a large corpus is read only until they are found).

Order, world size and accumulation. Sample position p of the run maps to window
g C + perm_g[p mod C] (g = p div C, C = data.shuffle_windows, perm_g a permutation seeded by
(seed, g)): a seeded shuffle inside consecutive groups of C windows, so a batch mixes windows
from different documents. The GlobalBatchSampler (train/data/sampler.py) hands out positions as
for any dataset, so the global batches are the same for any world size and accumulation and
each rank keeps its own slice. Every rank reads and tokenizes the whole stream (costs world size
x tokenization; each rank only packs the windows it trains on) -- the price of world-size
independence without random access; BENCHMARKS.md measures the tokenizer's throughput against
the trainer's appetite. `zerotrain prepare` tokenizes once instead: use it at scale.

Resume. A stream has no random access, so the data position in a checkpoint carries a cursor
(TrainState.data_cursor): the chunk K holding the first token of the current shuffle group
and the token offset in it. A resumed run restarts reading at chunk K and re-tokenizes at most
one group plus one chunk, never the stream from its start. Epochs: the length of a pass is
unknown before it is tokenized, so a stream is one endless epoch (train.epochs is refused; the
run lasts train.max_steps), and the files are simply read again, in a new order, pass after pass.

The pool. data.num_workers processes per rank (forked, started at the first sample) read and
tokenize chunks; the rank keeps 2 x workers + 2 chunks in flight and only slices windows out of
finished chunks. 0 = read and tokenize in the training process (on the step's critical path).
The tokens do not depend on the number of workers: chunks are tokenized independently and used in
stream order.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import zlib
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from train.data.prep_sources import DATASET_SUFFIXES, find_input_files, make_tokenizer
from train.data.sampler import GlobalBatchSampler
from train.errors import ConfigError, DataError

CHUNK_ROWS = 1024         # parquet / arrow rows per chunk at most ...
CHUNK_BYTES = 1 << 20     # ... and about this much text (JSON lines: a byte range of this size)
VAL_WINDOWS = 1024        # the validation set's size cap, in windows
STREAM_SAMPLES = 1 << 62  # "endless": the sampler's epoch (no stream ends inside a run)


def _fix_field(field: str) -> str:
    return f"set data.text_field to the field holding the text (now {field!r})"


# ----------------------------------------------------------------------------- files and chunks

class StreamFile:
    """One input file: its format, chunk count and (lazily) how to read chunk k's raw payload."""

    def __init__(self, path: Path, root: Path, field: str, chunk_rows: int, chunk_bytes: int):
        self.path, self.field = path, field
        self.name = str(path.relative_to(root)) if root.is_dir() else path.name
        self.kind = DATASET_SUFFIXES.get(path.suffix.lower())
        self.chunk_rows, self.chunk_bytes = chunk_rows, chunk_bytes
        self._table = None
        try:
            if self.kind == "parquet":
                import pyarrow.parquet as pq
                meta = pq.ParquetFile(str(path)).metadata
                self._check_field(meta.schema.to_arrow_schema().names)
                self.rows = meta.num_rows
                self.group_rows = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
                col = meta.schema.names.index(field) if field in meta.schema.names else 0
                self._size_chunks(sum(meta.row_group(i).column(col).total_uncompressed_size
                                      for i in range(meta.num_row_groups)))
            elif self.kind == "arrow":
                table = self._arrow()
                self._check_field(table.schema.names)
                self.rows = table.num_rows
                self._size_chunks(table.column(field).nbytes)
            elif self.kind == "json":
                self.size = path.stat().st_size
                self.chunks = -(-self.size // chunk_bytes)
                self._check_first_record()
            else:
                raise DataError(f"data.path: {path} is not a .parquet, .arrow or .jsonl file")
        except DataError:
            raise
        except Exception as e:  # pyarrow / OS errors: one line naming the file
            raise DataError(f"data.path: {path}: cannot read it as {self.kind} ({type(e).__name__}: "
                            f"{_first_line(e)}); fix or remove the file") from None

    def _size_chunks(self, text_bytes: int):
        """Rows per chunk: CHUNK_ROWS, fewer where rows are long (about CHUNK_BYTES of text a chunk)."""
        per_row = max(1, text_bytes // max(1, self.rows))
        self.chunk_rows = max(1, min(self.chunk_rows, self.chunk_bytes // per_row))
        self.chunks = -(-self.rows // self.chunk_rows)

    def _check_field(self, names):
        if self.field not in names:
            raise DataError(f"data.path: {self.path} has no field {self.field!r} (fields: {', '.join(names)}); "
                            f"{_fix_field(self.field)}")

    def _check_first_record(self):
        with open(self.path, "rb") as f:
            for line in f:
                if line.strip():
                    parse_json_docs(line, self, 0)  # raises naming the file
                    return

    def _arrow(self):
        if self._table is None:
            import pyarrow as pa
            source = pa.memory_map(str(self.path))
            try:
                self._table = pa.ipc.open_stream(source).read_all()  # `datasets`' .arrow files (zero copy)
            except pa.ArrowInvalid:
                source.seek(0)
                self._table = pa.ipc.open_file(source).read_all()
        return self._table

    def __getstate__(self):
        return {**self.__dict__, "_table": None}

    def payloads(self, k0: int):
        """(chunk k, first record id, raw payload) for k = k0, k0 + 1, ...: JSON lines as bytes,
        parquet/arrow text columns as Python lists (parquet decoded sequentially)."""
        if self.kind == "json":
            with open(self.path, "rb") as f:
                for k in range(k0, self.chunks):
                    a, b = k * self.chunk_bytes, min(self.size, (k + 1) * self.chunk_bytes)
                    start = a
                    if a > 0:  # the first line starting at or after a
                        f.seek(a - 1)
                        start = a - 1 + len(f.readline())
                    else:
                        f.seek(0)
                    raw = f.read(max(0, b - start))
                    if raw and not raw.endswith(b"\n") and b < self.size:
                        raw += f.readline()  # the line that starts before b ends after it
                    yield k, start, raw if start < b else b""
        elif self.kind == "arrow":
            column = self._arrow().column(self.field)
            for k in range(k0, self.chunks):
                yield k, k * self.chunk_rows, column.slice(k * self.chunk_rows, self.chunk_rows).to_pylist()
        else:
            yield from self._parquet_payloads(k0)

    def _parquet_payloads(self, k0: int):
        import pyarrow.parquet as pq
        row = k0 * self.chunk_rows
        starts = np.cumsum([0] + self.group_rows)
        g = int(np.searchsorted(starts, row, side="right")) - 1
        skip = row - int(starts[g])
        pending, k = [], k0
        pf = pq.ParquetFile(str(self.path))
        for batch in pf.iter_batches(batch_size=self.chunk_rows, row_groups=list(range(g, len(self.group_rows))),
                                     columns=[self.field]):
            values = batch.column(0).to_pylist()
            if skip:
                values, skip = values[skip:], max(0, skip - len(values))
            pending += values
            while len(pending) >= self.chunk_rows:
                yield k, k * self.chunk_rows, pending[:self.chunk_rows]
                pending, k = pending[self.chunk_rows:], k + 1
        if pending:
            yield k, k * self.chunk_rows, pending


def _first_line(e: Exception) -> str:
    s = str(e)
    return s.splitlines()[0][:200] if s else ""


def parse_json_docs(raw: bytes, f: StreamFile, start: int) -> list[tuple[int, str]]:
    """(byte offset, text) of each record of a JSON-lines byte range."""
    out, off = [], start
    for line in raw.split(b"\n"):
        here, off = off, off + len(line) + 1
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"data.path: {f.path}: byte {here}: not a JSON record ({e}); fix the line, or "
                            f"`zerotrain prepare` the file") from None
        if not isinstance(rec, dict) or f.field not in rec:
            fields = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
            raise DataError(f"data.path: {f.path}: record at byte {here} has no field {f.field!r} (fields: "
                            f"{fields or 'none'}); {_fix_field(f.field)}")
        out.append((here, _text(rec[f.field], f, f"record at byte {here}")))
    return out


def _text(value, f: StreamFile, where: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"data.path: {f.path}: {where}: field {f.field!r} is {type(value).__name__}, not text; "
                        f"{_fix_field(f.field)}")
    return value


def is_val(name: str, record: int, fraction: float) -> bool:
    """The seed-independent held-out test for a document (crc32 of file name and record id)."""
    return fraction > 0 and zlib.crc32(f"{name}\0{record}".encode()) < fraction * (1 << 32)


def chunk_docs(f: StreamFile, first: int, payload) -> list[tuple[int, str]]:
    if f.kind == "json":
        return parse_json_docs(payload, f, first)
    return [(first + i, _text(t, f, f"row {first + i}")) for i, t in enumerate(payload)]


def tokenize_docs(tokenizer, texts: list[str]) -> np.ndarray:
    """Each document's ids followed by the separator, concatenated (int32)."""
    if not texts:
        return np.zeros(0, dtype=np.int32)
    sep = np.asarray(tokenizer.separator, dtype=np.int32)
    parts = []
    for ids in tokenizer.encode_batch([t.encode("utf-8") for t in texts]):
        parts += [np.asarray(ids, dtype=np.int32), sep]
    return np.concatenate(parts)


def tokenize_chunk(tokenizer, f: StreamFile, first: int, payload, val_fraction: float, val: bool = False):
    """The tokens of a chunk's training (or, val=True, held-out) documents."""
    docs = chunk_docs(f, first, payload)
    return tokenize_docs(tokenizer, [t for r, t in docs if is_val(f.name, r, val_fraction) == val])


_WORKER_TOKENIZER = None


def _init_worker(spec):
    global _WORKER_TOKENIZER
    # A preemption signal sent to every process of the job (scancel, Ctrl-C) is the rank's to handle:
    # it finishes its step, which may need this worker, and saves. The pool ends by its own shutdown.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # die with the rank (a killed rank's forked workers would otherwise wait on the queue forever)
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    # Never touch torch here: its OpenMP pool, forked from a rank that used it, spins forever.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism (as prepare's)
    _WORKER_TOKENIZER = make_tokenizer(spec)


def _end_pool(pool):
    """Cancel the queued chunks and kill the workers: their tokens are no longer wanted. A plain
    shutdown is not enough on Python 3.11: measured, 1 finished run in 5-8 waited forever at exit,
    the pool's manager thread and multiprocessing's exit hook joining a worker that never got its
    stop sentinel (blocked in its call queue's get). The workers ignore SIGTERM (the rank's), so SIGKILL."""
    workers = list((getattr(pool, "_processes", None) or {}).values())  # no public handle on 3.11
    pool.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        w.kill()
    for w in workers:
        w.join(timeout=10)


def _work(f: StreamFile, first: int, payload, val_fraction: float):
    return tokenize_chunk(_WORKER_TOKENIZER, f, first, payload, val_fraction)


# ----------------------------------------------------------------------------- the corpus

class StreamCorpus:
    """The files, their chunks and the pass order: chunk K of the endless stream."""

    def __init__(self, path: str, field: str, seed: int, chunk_rows: int = CHUNK_ROWS,
                 chunk_bytes: int = CHUNK_BYTES):
        root = Path(path).expanduser()
        if not root.exists():
            raise DataError(f"data.path {root} does not exist (data.kind = stream reads a .parquet/.arrow/.jsonl "
                            f"file or a directory of them)")
        try:
            files = find_input_files([str(root)], DATASET_SUFFIXES, "dataset files")
        except (DataError, ConfigError) as e:
            raise DataError(f"data.path: {str(e).removeprefix('prepare: ')}; data.kind = stream reads .parquet, "
                            f".arrow and .jsonl files") from None
        self.root, self.seed = root, seed
        self.files = [StreamFile(p, root, field, chunk_rows, chunk_bytes) for p in files]
        self.counts = [f.chunks for f in self.files]
        self.per_pass = sum(self.counts)
        if self.per_pass == 0:
            raise DataError(f"data.path {root}: its files hold no records; {_fix_field(field)} or add data")
        self._orders: dict[int, tuple] = {}

    def pass_order(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(file order, cumulative chunk starts) of pass p."""
        if p not in self._orders:
            if len(self._orders) > 4:
                self._orders.pop(min(self._orders))
            order = np.random.default_rng([self.seed, p]).permutation(len(self.files))
            starts = np.cumsum([0] + [self.counts[i] for i in order])
            self._orders[p] = (order, starts)
        return self._orders[p]

    def locate(self, K: int) -> tuple[int, int]:
        """(file index, chunk within the file) of stream chunk K."""
        p, i = divmod(K, self.per_pass)
        order, starts = self.pass_order(p)
        j = int(np.searchsorted(starts, i, side="right")) - 1
        return int(order[j]), i - int(starts[j])

    def payloads(self, K0: int):
        """(K, file, first record id, payload) for K = K0, K0 + 1, ... (endless)."""
        K = K0
        while True:
            fi, k = self.locate(K)
            f = self.files[fi]
            for k, first, payload in f.payloads(k):
                yield K, f, first, payload
                K += 1
            # a file's last chunk may hold no record: K advanced past it all the same

    def fingerprint(self) -> dict:
        return {"files": len(self.files), "chunks_per_pass": self.per_pass}

    def __getstate__(self):
        return {**self.__dict__, "_orders": {}}


# ----------------------------------------------------------------------------- windows

class StreamWindows(Dataset):
    """Window w of the token stream (see the module docstring), read in increasing order of the
    shuffle groups; going back restarts at the best cursor known (else the stream's start)."""

    def __init__(self, corpus: StreamCorpus, seq_len: int, tokenizer_spec: Optional[str], workers: int,
                 group: int, val_fraction: float, tokenizer=None):
        self.corpus, self.T, self.spec, self.workers = corpus, seq_len, tokenizer_spec, workers
        self.group, self.val_fraction = group, val_fraction
        self.tokenizer = tokenizer or make_tokenizer(tokenizer_spec)
        self.cursors: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()  # group -> (K, off)
        self.chunks_tokenized = 0  # chunks this process read (a resume's cost, for tests and logs)
        self._pool = None
        self._reset(0, 0, 0)

    def __len__(self) -> int:
        return STREAM_SAMPLES

    def __getstate__(self):
        return {**self.__dict__, "_pool": None, "_pending": collections.deque(), "_source": None}

    # -- the buffer: chunks [(start token, K, tokens)] covering [lo, hi)
    def _reset(self, K: int, position: int, off: int):
        for _, job in getattr(self, "_pending", ()):
            if hasattr(job, "cancel"):
                job.cancel()  # chunks of the old position not started yet
        self._buf: collections.deque = collections.deque()
        self._next_K, self._next_start = K, position - off
        self.lo = self.hi = position
        self._pending: collections.deque = collections.deque()
        self._source = None

    def _submit(self):
        if self._source is None:
            self._source = self.corpus.payloads(self._next_K)
        K, f, first, payload = next(self._source)
        if self.workers > 0:
            if self._pool is None:
                self._start_pool()
            self._pending.append((K, self._pool.submit(_work, f, first, payload, self.val_fraction)))
        else:
            self._pending.append((K, (f, first, payload)))

    def _start_pool(self):
        import multiprocessing
        import weakref
        from concurrent.futures import ProcessPoolExecutor
        # The pool is the parallelism: a forked Rust tokenizer would otherwise warn and turn its own off.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        # concurrent.futures, not multiprocessing.Pool: a worker that dies fails the run (BrokenProcessPool)
        # instead of leaving its task waited on forever.
        self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"),
                                         initializer=_init_worker, initargs=(self.spec,))
        self._finalize_pool = weakref.finalize(self, _end_pool, self._pool)  # at close, garbage collection or exit

    def _pull(self):
        depth = 2 * self.workers + 2 if self.workers else 1
        while len(self._pending) < depth:
            self._submit()
        K, job = self._pending.popleft()
        tokens = job.result() if self.workers > 0 else tokenize_chunk(self.tokenizer, *job, self.val_fraction)
        self.chunks_tokenized += 1
        start = self._next_start
        if K != self._next_K:
            raise AssertionError(f"stream chunk {K} arrived, {self._next_K} expected")
        self._next_K, self._next_start = K + 1, start + len(tokens)
        end = start + len(tokens)
        if len(tokens):
            self._buf.append((start, K, tokens))
            self._empty = 0
        else:
            self._empty = getattr(self, "_empty", 0) + 1
            if self._empty >= self.corpus.per_pass:  # a whole pass without a token: it would loop forever
                raise DataError(f"data.path {self.corpus.root}: no training text in a whole pass over its files (every "
                                f"document empty or held out by data.val_fraction {self.val_fraction}); add data or "
                                f"lower data.val_fraction")
        self.hi = end
        self.lo = self._buf[0][0] if self._buf else self.hi

    def _record(self, g: int, K: int, off: int):
        self.cursors[g] = (K, off)
        self.cursors.move_to_end(g)
        while len(self.cursors) > 16:
            self.cursors.popitem(last=False)

    def _cursor_of(self, g: int) -> tuple[int, int]:
        """(chunk, offset) of group g's first token, reading on to it if needed; recorded."""
        pos = g * self.group * self.T
        if g not in self.cursors:
            if pos < self.lo:
                self._seek(g)
            while self.hi <= pos:
                self._pull()
            start, K, _ = next(c for c in self._buf if c[0] <= pos < c[0] + len(c[2]))
            self._record(g, K, pos - start)
        return self.cursors[g]

    def _seek(self, g: int):
        known = [h for h in self.cursors if h <= g]
        h = max(known) if known else None
        K, off = self.cursors[h] if h is not None else (0, 0)
        self._reset(K, (h or 0) * self.group * self.T, off)
        if h is not None:
            self._record(h, K, off)

    def __getitem__(self, w: int) -> dict:
        w = int(w)
        a, b = w * self.T, w * self.T + self.T + 1
        g = w // self.group
        cursor = self.cursors.get(g)
        if a < self.lo or (cursor is not None and g * self.group * self.T > self.hi):
            self._seek(g)
        while self.hi < b:
            self._pull()
        self._cursor_of(g)  # before the chunks ahead of it are dropped: where a resume restarts
        # Drop chunks wholly before this group: groups are read in increasing order.
        floor = g * self.group * self.T
        while len(self._buf) > 1 and self._buf[0][0] + len(self._buf[0][2]) <= min(floor, a):
            self._buf.popleft()
            self.lo = self._buf[0][0]
        parts, need = [], a
        for start, _, tok in self._buf:
            if start + len(tok) <= need:
                continue
            take = tok[need - start: b - start]
            parts.append(take)
            need += len(take)
            if need >= b:
                break
        window = torch.from_numpy(np.concatenate(parts).astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    # -- the data position in checkpoints
    def cursor_at(self, offset: int) -> dict:
        """The cursor of the shuffle group holding sample position `offset`: what a resume needs."""
        g = offset // self.group
        K, off = self._cursor_of(g)
        return {"window": g * self.group, "chunk": K, "token": off, **self.corpus.fingerprint()}

    def resume_from(self, cursor: Optional[dict]):
        if not cursor:
            return
        if {k: cursor.get(k) for k in self.corpus.fingerprint()} != self.corpus.fingerprint() \
                or cursor["window"] % self.group:
            raise DataError(f"data.path {self.corpus.root}: the checkpoint's stream position ({cursor['files']} "
                            f"files, {cursor['chunks_per_pass']} chunks per pass, shuffle group at window "
                            f"{cursor['window']}) does not fit these files and data.shuffle_windows "
                            f"({self.corpus.fingerprint()}, {self.group}); resume with the same data, or start a new "
                            f"run from its weights with model.init_from")
        self._record(cursor["window"] // self.group, cursor["chunk"], cursor["token"])

    def close(self):
        """End the tokenizer pool now (the trainer's close; a finished run needs no more chunks)."""
        if self._pool is not None:
            self._pool = None
            self._finalize_pool()  # runs once


class StreamSampler(GlobalBatchSampler):
    """GlobalBatchSampler over the endless stream: position p -> window g C + perm_g[p mod C]."""

    def __init__(self, group: int, micro: int, world: int, accum: int, seed: int):
        super().__init__(STREAM_SAMPLES, micro, world, accum, seed, what="stream")
        self.group = group
        self._perms: dict[int, np.ndarray] = {}

    def window(self, p: int) -> int:
        g, i = divmod(p, self.group)
        if self.group == 1:
            return p
        if g not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[g] = np.random.default_rng([self.seed % (1 << 64), g]).permutation(self.group)
        return g * self.group + int(self._perms[g][i])

    def order(self, epoch: int):
        raise NotImplementedError("a stream's order is endless: use slicer()")

    def slicer(self, epoch: int):
        return lambda a, b: [self.window(p) for p in range(a, b)]


# ----------------------------------------------------------------------------- the bundle

def val_tokens(corpus: StreamCorpus, tokenizer, fraction: float, need: int) -> np.ndarray:
    """The held-out documents' tokens in file order, until `need` tokens (or the corpus) ran out."""
    parts, total = [], 0
    if fraction <= 0:
        return np.zeros(0, dtype=np.int32)
    for f in corpus.files:
        for _, first, payload in f.payloads(0):
            t = tokenize_chunk(tokenizer, f, first, payload, fraction, val=True)
            parts.append(t)
            total += len(t)
            if total >= need:
                return np.concatenate(parts)[:need]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def default_workers() -> int:
    """data.num_workers unset: one tokenizer process per rank per spare core, 1 to 4 (a rank
    tokenizes the whole stream, so a node with more ranks than cores still gets 1 each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    per_rank = cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(4, per_rank - 1))


def build_stream(cfg, seq_len: Optional[int], seed: int, tokenizer: Optional[str]):
    from train.data.bundle import DataBundle
    from train.data.text import TokenSequences
    if cfg.path is None:
        raise DataError("data.kind = stream needs data.path (a .parquet/.arrow/.jsonl file or a directory of them)")
    if seq_len is None:
        raise DataError("data.kind = stream needs data.seq_len (the model has no context length to default to)")
    field = cfg.text_field or "text"
    group = cfg.shuffle_windows or 1
    workers = default_workers() if cfg.num_workers is None else cfg.num_workers
    corpus = StreamCorpus(cfg.path, field, seed)
    tok = make_tokenizer(tokenizer)
    eos = None
    if cfg.document_mask:  # every document is followed by the separator: no occurrence to check
        import train.data.document_mask as document_mask
        eos = document_mask.resolve_eos(cfg, f"data.path {corpus.root} (tokenized by {tokenizer or 'bytes'})",
                                        tok.name, list(tok.separator), None)
    train = StreamWindows(corpus, seq_len, tokenizer, workers, group, cfg.val_fraction, tokenizer=tok)
    held = val_tokens(corpus, tok, cfg.val_fraction, VAL_WINDOWS * seq_len + 1)
    val = TokenSequences(held, seq_len) if len(held) > seq_len + 1 else None
    decode = None
    if tok.name == "bytes":
        from train.data.text import decode
    names = ", ".join(f.name for f in corpus.files[:3]) + (", ..." if len(corpus.files) > 3 else "")
    bundle = DataBundle(train=train, val=val, task="lm", items_per_sample=seq_len, vocab_size=tok.vocab_size,
                        seq_len=seq_len, decode=decode, stream=train,
                        describe=f"streamed {len(corpus.files)} file(s) under {corpus.root} ({names}; field "
                                 f"{field!r}, {corpus.per_pass} chunks per pass), tokenized by "
                                 f"{'bytes' if tok.name == 'bytes' else tokenizer} in {workers} worker(s) per rank, "
                                 f"windows of {seq_len} shuffled in groups of {group}; val: "
                                 f"{len(val) if val else 0} windows of held-out documents",
                        extra={"tokenizer": tok.name, "stream_workers": workers})
    return bundle if eos is None else document_mask.apply(bundle, eos)
