"""The stream's files, their chunks and the pass order: the reading half of data.kind stream.

data.path is a file or a directory (found as `zerotrain prepare` finds them). Each file is cut into
chunks without a scan: parquet and arrow files by rows (at most CHUNK_ROWS, fewer so that a chunk
holds about CHUNK_BYTES of text; row counts and column sizes come from the parquet footer / the
memory-mapped arrow table), JSON lines by byte ranges of CHUNK_BYTES (a record belongs to the range
its line starts in). Pass p visits every file once, in a permutation seeded by (seed, p), each
file's chunks in order (parquet decodes sequentially). The passes follow each other without end:
chunk K of the stream is chunk K mod N of pass K div N (N chunks per pass).

A chunk's documents are its records' data.text_field; each is tokenized with the run's tokenizer
and followed by the tokenizer's separator (newline for bytes, EOS otherwise). A document is held
out for validation when crc32(file name relative to data.path, record id) / 2^32 <
data.val_fraction (record id: row number, or byte offset of a JSON line): a seed-independent
split that training never sees.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np

from zerotrain.train.data.prep_sources import DATASET_SUFFIXES, find_input_files
from zerotrain.train.errors import ConfigError, DataError

CHUNK_ROWS = 1024         # parquet / arrow rows per chunk at most ...
CHUNK_BYTES = 1 << 20     # ... and about this much text (JSON lines: a byte range of this size)


def _fix_field(field: str) -> str:
    return f"set data.text_field to the field holding the text (now {field!r})"


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
