"""Where instruction and preference records come from, and which record format they are in.

A data.path of data.kind sft / preference (and text) is one of
  * a JSONL file (one JSON object per line; errors name file:line), or a glob of them;
  * a table: a .parquet or .arrow (`datasets`' Arrow stream) file, a glob of them, a directory
    `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote, or a Hub dataset id (its snapshot
    in huggingface_hub's cache; `datasets` says which files hold which subset and split). Rows
    are read by pyarrow from the files themselves, BATCH_ROWS at a time, only the columns the
    format needs, and freed once tokenized: no copy of the table is made (no conversion into a
    cache) and nothing holds or maps it whole (bench/table_memory.py: a 1 GB parquet set peaks
    at 1.19x the RSS of a 10 MB one, the tokens each rank keeps being the difference). Errors
    name file:row N, the 0-based row in that file.

The format is found from the columns (a table's, or a JSONL record's keys), as TRL names them
(https://huggingface.co/docs/trl/dataset_formats), each standard (strings) or conversational
(lists of {"role", "content"} messages):

  data.kind sft         messages             language modeling, conversational
                        text                 language modeling, standard
                        prompt + completion  prompt-completion
                        prompt + response    zerotrain's prompt-response (as before TRL's names)
  data.kind preference  prompt + chosen + rejected   preference, explicit prompt
                        chosen + rejected            preference, implicit prompt (the shared
                                                     prefix is the prompt: extract_prompt)

Where several fit, the first in the order of SFT_FORMATS / PREFERENCE_FORMATS wins (messages,
prompt + completion, prompt + response, text; explicit before implicit prompt). Other columns
are ignored. A column set that matches none is one line listing the columns and the formats
accepted.
"""

from __future__ import annotations

import glob as globlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from zerotrain.train.errors import DataError

TABLE_SUFFIXES = (".parquet", ".arrow")
JSONL_SUFFIXES = (".jsonl", ".json")
BATCH_ROWS = 1024  # rows converted to Python at a time


@dataclass(frozen=True)
class Format:
    name: str                  # what the banner says
    columns: tuple[str, ...]   # the columns that make it


SFT_FORMATS = (Format("language modeling (messages)", ("messages",)),
               Format("prompt-completion", ("prompt", "completion")),
               Format("prompt-response", ("prompt", "response")),
               Format("language modeling (text)", ("text",)))
PREFERENCE_FORMATS = (Format("preference, explicit prompt", ("prompt", "chosen", "rejected")),
                      Format("preference, implicit prompt", ("chosen", "rejected")))
TEXT_FORMATS = (Format("language modeling (text)", ("text",)),)
FORMATS = {"sft": SFT_FORMATS, "preference": PREFERENCE_FORMATS, "text": TEXT_FORMATS}
OTHER_KIND = {"sft": ("chosen", "preference"), "preference": ("completion", "sft")}


def accepted(kind: str) -> str:
    return "; ".join(" + ".join(f.columns) + f" ({f.name})" for f in FORMATS[kind])


def detect(columns, kind: str) -> Optional[Format]:
    """The first format of `kind` whose columns are all present (None: no format fits)."""
    have = set(columns)
    return next((f for f in FORMATS[kind] if set(f.columns) <= have), None)


def no_format(where: str, columns, kind: str) -> DataError:
    other = OTHER_KIND.get(kind)
    hint = (f"; a {other[0]!r} column is data.kind {other[1]}'s" if other and other[0] in set(columns) else "")
    return DataError(f"{where}: the columns {', '.join(sorted(columns)) or '(none)'} match no record format of "
                     f"data.kind {kind}; accepted: {accepted(kind)}{hint}")


def flavour(value) -> str:
    """TRL's standard (a string) or conversational (a list of messages)."""
    return "conversational" if isinstance(value, list) else "standard"


# ----------------------------------------------------------------------------- sources

@dataclass
class Part:
    """One file of a table."""
    label: str       # what errors call it (the file, or the Hub id's split)
    kind: str        # "parquet" | "arrow" (datasets' Arrow stream files)
    rows: int
    path: str        # the file read


@dataclass
class Table:
    """Files of rows (parquet, or `datasets`' Arrow stream files) as one table, in order. Rows are
    read by pyarrow from the files, a batch at a time (read, not memory-mapped: a mapped page a
    rank touched would stay in its RSS, so reading a 1 GB set through a map grew each rank's RSS
    by the set's size, bench/table_memory.py); each batch is freed once its rows are tokenized."""
    name: str                                       # what the banner calls it
    columns: list[str]
    parts: list[Part] = field(default_factory=list)
    dataset: object = None               # else: a datasets.Dataset (Hub JSON files), sliced BATCH_ROWS at a time

    def where(self, i: int) -> str:
        for part in self.parts:
            if i < part.rows:
                return f"{part.label}:row {i}"
            i -= part.rows
        return f"{self.name}:row {i}"

    def __len__(self) -> int:
        return len(self.dataset) if self.dataset is not None else sum(p.rows for p in self.parts)


@dataclass
class Source:
    """data.path opened: JSONL files (read line by line) or a Table."""
    spec: str                            # data.path as given
    jsonl: list[Path] = field(default_factory=list)
    table: Optional[Table] = None
    val_table: Optional[Table] = None    # a save_to_disk DatasetDict's validation split, a sibling .val file
    val_name: Optional[str] = None

    @property
    def is_table(self) -> bool:
        return self.table is not None


def is_glob(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def is_dataset_dir(p: Path) -> bool:
    return p.is_dir() and any((p / f).is_file() for f in ("state.json", "dataset_dict.json", "dataset_info.json"))


def is_table_spec(spec: str) -> bool:
    """Whether data.path names something `datasets` reads (else: one JSONL file, as before)."""
    import zerotrain.models.hub as hub
    p = Path(spec).expanduser()
    if is_glob(spec) or hub.parse(spec, "dataset") is not None:
        return True
    return is_dataset_dir(p) or p.suffix.lower() in TABLE_SUFFIXES


def _datasets():
    import datasets  # late: slow imports that only table sources need
    datasets.disable_progress_bars()
    return datasets


def _glob(spec: str, kind: str) -> list[Path]:
    files = sorted(Path(f) for f in globlib.glob(str(Path(spec).expanduser()), recursive=True)
                   if Path(f).is_file() and not Path(f).stem.endswith(".val"))
    if not files:
        raise DataError(f"data.path {spec}: the pattern matches no file; data.kind {kind} reads .jsonl, .parquet "
                        f"or .arrow files")
    suffixes = {f.suffix.lower() for f in files}
    if len(suffixes) > 1 or not suffixes <= set(TABLE_SUFFIXES + JSONL_SUFFIXES):
        raise DataError(f"data.path {spec}: the pattern matches {', '.join(sorted(suffixes))} files; give files of "
                        f"one kind (.jsonl, .parquet or .arrow)")
    return files


def _load_files(files: list[Path], spec: str) -> Table:
    """.parquet / .arrow files as one table, in the given order: only their metadata is read here."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    parts, columns = [], None
    for f in files:
        try:
            if f.suffix.lower() == ".arrow":  # datasets' Arrow stream files
                with pa.OSFile(str(f)) as src:
                    reader = pa.ipc.open_stream(src)
                    schema, rows = reader.schema, sum(b.num_rows for b in reader)
                parts.append(Part(str(f), "arrow", rows, str(f)))
            else:
                meta = pq.ParquetFile(str(f))
                schema, rows = meta.schema_arrow, meta.metadata.num_rows
                parts.append(Part(str(f), "parquet", rows, str(f)))
        except Exception as e:  # noqa: BLE001 - a corrupt or unreadable file: one line naming it
            raise DataError(f"data.path {spec}: {f} cannot be read as {f.suffix[1:]} ({type(e).__name__}: "
                            f"{(str(e).splitlines() or [''])[0][:200]}); give .parquet/.arrow files") from None
        columns = columns if columns is not None else list(schema.names)
        if list(schema.names) != columns:
            raise DataError(f"data.path {spec}: {f} has the columns {', '.join(schema.names)}, {parts[0].path} "
                            f"{', '.join(columns)}; give files of one table")
    return Table(name=spec, columns=columns or [], parts=parts)


def _dataset_files(directory: Path) -> list[Path]:
    """The Arrow files of one `Dataset.save_to_disk` directory (its state.json lists them)."""
    try:
        state = json.loads((directory / "state.json").read_text())
        return [directory / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"data.path {directory}: not a directory `datasets` save_to_disk wrote (state.json: "
                        f"{type(e).__name__}: {e})") from None


VAL_SPLITS = ("validation", "test")


def _pick_split(d: dict, name: str, split: Optional[str], kind: str, key_hint: str):
    """(train Table, validation Table or None, its description) of splits {name: () -> Table}."""
    want = split or "train"
    if want not in d:
        raise DataError(f"data.path {name} has no split \"{want}\" (its splits: {', '.join(d) or 'none'}); "
                        f"set data.split to one of them{key_hint}")
    val = next((s for s in VAL_SPLITS if s in d), None) if want == "train" else None
    return d[want](), d[val]() if val else None, f"split {val!r}" if val else None


def _load_dir(p: Path, kind: str, split: Optional[str]) -> tuple[Table, Optional[Table], Optional[str]]:
    if (p / "dataset_dict.json").is_file():  # a DatasetDict: one directory per split
        try:
            splits = json.loads((p / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError) as e:
            raise DataError(f"data.path {p}: unreadable dataset_dict.json ({type(e).__name__}: {e})") from None
        d = {sp: (lambda sp=sp: _load_files(_dataset_files(p / sp), f"{p}[{sp}]")) for sp in splits}
        return _pick_split(d, str(p), split, kind, "")
    if split is not None:
        raise DataError(f"data.split {split}: data.path {p} is one Dataset, not a DatasetDict with splits; remove "
                        f"data.split")
    return _load_files(_dataset_files(p), str(p)), None, None


def _load_hub(spec: str, kind: str, subset: Optional[str], split: Optional[str]):
    """A Hub dataset id: its snapshot in huggingface_hub's cache (fetched, one process per node,
    by train/launch/hub_fetch.py). `datasets` says which files are which subset and split (its
    README's configs, else the Hub's file names: train-*.parquet, data/test-*, ...); parquet and
    arrow files are then read as local ones, other files (JSON) through `datasets`' own table."""
    import zerotrain.models.hub as hub
    h = hub.parse(spec, "dataset")
    directory, commit = hub.local_snapshot(h, "data.path")
    name = f"{h.repo}@{h.rev}" + (f"/{subset}" if subset else "")
    ds_mod = _datasets()
    try:
        builder = ds_mod.load_dataset_builder(str(directory), name=subset)
        data_files = dict(builder.config.data_files or {})
    except Exception as e:  # noqa: BLE001 - an unknown subset, files datasets cannot read: one line
        raise DataError(f"data.path {h.repo}@{h.rev} (commit {commit}){' data.subset ' + subset if subset else ''}: "
                        f"`datasets` cannot load it ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}); "
                        f"check data.subset") from None

    def table(sp: str):
        files = [Path(str(f)) for f in data_files[sp]]
        if files and all(f.suffix.lower() in TABLE_SUFFIXES for f in files):
            t = _load_files(files, f"{name}[{sp}]")
            for part in t.parts:  # errors name the id and split (and the file, where the split has several)
                part.label = f"{name}[{sp}]" + (f" {Path(part.path).name}" if len(files) > 1 else "")
            return t
        builder.download_and_prepare()  # JSON files: converted into datasets' cache (memory-mapped)
        d = builder.as_dataset(split=sp)
        return Table(name=f"{name}[{sp}]", columns=list(d.column_names), dataset=d)
    return _pick_split({sp: (lambda sp=sp: table(sp)) for sp in data_files}, name, split, kind,
                       " (and data.subset for another subset)")


def open_source(spec: str, kind: str, subset: Optional[str] = None, split: Optional[str] = None) -> Source:
    """data.path of data.kind `kind` opened (nothing read but the tables' metadata)."""
    import zerotrain.models.hub as hub
    p = Path(spec).expanduser()
    if hub.parse(spec, "dataset") is not None:
        table, val, val_name = _load_hub(spec, kind, subset, split)
        return Source(spec, table=table, val_table=val, val_name=val_name)
    if subset is not None:
        raise DataError(f"data.subset {subset}: data.path {spec} is not a Hub dataset id; remove data.subset")
    if is_dataset_dir(p):
        table, val, val_name = _load_dir(p, kind, split)
        return Source(spec, table=table, val_table=val, val_name=val_name)
    if split is not None:
        raise DataError(f"data.split {split}: data.path {spec} is neither a Hub dataset id nor a save_to_disk "
                        f"DatasetDict; remove data.split")
    if is_glob(spec):
        files = _glob(spec, kind)
        if files[0].suffix.lower() in JSONL_SUFFIXES:
            return Source(spec, jsonl=files)
        return Source(spec, table=_load_files(files, spec))
    if p.suffix.lower() in TABLE_SUFFIXES:
        if not p.is_file():
            raise DataError(f"data.path {p} does not exist (data.kind {kind} reads a .jsonl, .parquet or .arrow "
                            f"file, a glob of them, a save_to_disk directory, or a Hub dataset id)")
        sibling = p.with_name(p.stem + ".val" + p.suffix)
        val = _load_files([sibling], str(sibling)) if sibling.is_file() and sibling != p else None
        return Source(spec, table=_load_files([p], str(p)), val_table=val, val_name=sibling.name if val else None)
    return Source(spec, jsonl=[p])


# ----------------------------------------------------------------------------- rows

def jsonl_rows(lines, name, kind: str, hint: str) -> Iterator[tuple[str, int, dict]]:
    """(file:line, line, record) of every non-blank line of JSONL `lines` (bytes); a line that is
    not a UTF-8 JSON object raises DataError naming file:line."""
    for lineno, raw in enumerate(lines, 1):
        where = f"{name}:{lineno}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{where}: not UTF-8 text; data.kind {kind} reads JSONL (UTF-8, one JSON object "
                            f"per line)") from None
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg}, column {e.colno}); data.kind {kind} reads JSONL, one "
                            f"{hint} object per line") from None
        if not isinstance(rec, dict):
            raise DataError(f"{where}: a JSON {type(rec).__name__}, not a record object ({hint})")
        yield where, lineno, rec


def _batches(table: Table, columns: list[str]):
    """(what errors call the file, record batch of `columns`) in row order, read from the files
    BATCH_ROWS rows at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if table.dataset is not None:
        ds = table.dataset.select_columns(columns).with_format("arrow")
        for start in range(0, len(ds), BATCH_ROWS):
            yield table.name, ds[start:start + BATCH_ROWS]
        return
    for part in table.parts:
        if part.kind == "parquet":
            # pre_buffer off: pyarrow's default prefetches every row group iter_batches will read,
            # which held the whole 1 GB file in memory (1.28 GB peak RSS vs 0.15 GB, bench/table_memory.py)
            f = pq.ParquetFile(part.path, pre_buffer=False, buffer_size=1 << 20)
            for batch in f.iter_batches(batch_size=BATCH_ROWS, columns=columns):
                yield part.label, batch
        else:
            with pa.OSFile(part.path) as src:  # read, not mapped
                for batch in pa.ipc.open_stream(src):
                    yield part.label, batch.select(columns)


def table_rows(table: Table, fmt: Format) -> Iterator[tuple[str, int, dict]]:
    """(file:row N, N, record) of every row, only `fmt`'s columns (N counts from 0 in each file;
    the number yielded is the row of the whole table). A null cell reads as a missing key."""
    i, label, in_part = 0, None, 0
    for part, batch in _batches(table, list(fmt.columns)):
        if part != label:
            label, in_part = part, 0
        cols = [batch.column(c).to_pylist() for c in fmt.columns]
        for values in zip(*cols):
            yield f"{label}:row {in_part}", i, {c: v for c, v in zip(fmt.columns, values) if v is not None}
            i += 1
            in_part += 1


def table_format(table: Table, kind: str) -> Format:
    fmt = detect(table.columns, kind)
    if fmt is None:
        raise no_format(table.name, table.columns, kind)
    return fmt
