"""Where instruction and preference records come from, and which record format they are in.

A data.path of data.kind sft / preference (and text) is one of
  * a JSONL file (one JSON object per line; errors name file:line), or a glob of them;
  * a table that `datasets` reads: a .parquet or .arrow file, a glob of them, or a directory
    `Dataset.save_to_disk` / `DatasetDict.save_to_disk` wrote. Arrow is memory-mapped (`.arrow`
    files and save_to_disk directories in place; parquet once converted into `datasets`' cache,
    one conversion per cache, under `datasets`' own lock), and rows are read in batches of only
    the columns the format needs: nothing holds the whole table. Errors name file:row N, the
    0-based index `datasets` gives the row in that file.

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

Other columns are ignored. A column set that matches none is one line listing the columns and
the formats accepted.
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
class Table:
    """A `datasets` table and where each of its rows comes from."""
    dataset: object                      # datasets.Dataset, memory-mapped
    name: str                            # what the banner calls it
    parts: list[tuple[str, int]] = field(default_factory=list)  # (file, rows) in order; [] = one named source

    def where(self, i: int) -> str:
        for name, n in self.parts:
            if i < n:
                return f"{name}:row {i}"
            i -= n
        return f"{self.name}:row {i}"

    @property
    def columns(self) -> list[str]:
        return list(self.dataset.column_names)


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
    """.parquet / .arrow files as one memory-mapped table, in the given order."""
    ds_mod = _datasets()
    suffix = files[0].suffix.lower()
    try:
        if suffix == ".arrow":  # datasets' own Arrow stream files: mapped in place, no copy
            parts = [ds_mod.Dataset.from_file(str(f)) for f in files]
            counts = [len(p) for p in parts]
            ds = parts[0] if len(parts) == 1 else ds_mod.concatenate_datasets(parts)
        else:
            import pyarrow.parquet as pq
            counts = [pq.ParquetFile(str(f)).metadata.num_rows for f in files]
            ds = ds_mod.load_dataset("parquet", data_files=[str(f) for f in files], split="train")
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt or unreadable file: one line naming it
        raise DataError(f"data.path {spec}: `datasets` cannot read it ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]}); give .parquet/.arrow files it can") from None
    return Table(dataset=ds, name=spec, parts=[(str(f), n) for f, n in zip(files, counts)])


VAL_SPLITS = ("validation", "test")


def _pick_split(d: dict, name: str, split: Optional[str], kind: str, key_hint: str):
    """(train Table, validation Table or None, its description) of a DatasetDict."""
    want = split or "train"
    if want not in d:
        raise DataError(f"data.path {name} has no split \"{want}\" (its splits: {', '.join(d) or 'none'}); "
                        f"set data.split to one of them{key_hint}")
    val = next((s for s in VAL_SPLITS if s in d), None) if want == "train" else None
    return (Table(d[want], f"{name}[{want}]"), Table(d[val], f"{name}[{val}]") if val else None,
            f"split {val!r}" if val else None)


def _load_dir(p: Path, kind: str, split: Optional[str]) -> tuple[Table, Optional[Table], Optional[str]]:
    ds_mod = _datasets()
    try:
        d = ds_mod.load_from_disk(str(p))  # memory-mapped in place
    except Exception as e:  # noqa: BLE001
        raise DataError(f"data.path {p}: not a directory `datasets` save_to_disk wrote ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]})") from None
    if isinstance(d, ds_mod.DatasetDict):
        return _pick_split(d, str(p), split, kind, "")
    if split is not None:
        raise DataError(f"data.split {split}: data.path {p} is one Dataset, not a DatasetDict with splits; remove "
                        f"data.split")
    return Table(d, str(p)), None, None


def _load_hub(spec: str, kind: str, subset: Optional[str], split: Optional[str]):
    """A Hub dataset id: its snapshot in huggingface_hub's cache (fetched, one process per node,
    by train/launch/hub_fetch.py), read by `datasets` as a local directory: its README's subsets
    and split names, else the file-name conventions (train-*.parquet, data/test-*, ...)."""
    import zerotrain.models.hub as hub
    h = hub.parse(spec, "dataset")
    directory, commit = hub.local_snapshot(h, "data.path")
    name = f"{h.repo}@{h.rev}" + (f" subset {subset}" if subset else "")
    ds_mod = _datasets()
    try:
        d = ds_mod.load_dataset(str(directory), name=subset)
    except Exception as e:  # noqa: BLE001 - an unknown subset, files datasets cannot read: one line
        raise DataError(f"data.path {h.repo}@{h.rev} (commit {commit}){' data.subset ' + subset if subset else ''}: "
                        f"`datasets` cannot load it ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:240]}); "
                        f"check data.subset") from None
    return _pick_split(d, name, split, kind, " (and data.subset for another subset)")


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


def table_rows(table: Table, fmt: Format) -> Iterator[tuple[str, int, dict]]:
    """(file:row N, N, record) of every row, only `fmt`'s columns, read BATCH_ROWS at a time from
    the memory-mapped table. A null cell reads as a missing key."""
    ds = table.dataset.select_columns(list(fmt.columns))
    for start in range(0, len(ds), BATCH_ROWS):
        batch = ds[start:start + BATCH_ROWS]
        for j in range(len(batch[fmt.columns[0]])):
            i = start + j
            yield table.where(i), i, {c: batch[c][j] for c in fmt.columns if batch[c][j] is not None}


def table_format(table: Table, kind: str) -> Format:
    fmt = detect(table.columns, kind)
    if fmt is None:
        raise no_format(table.name, table.columns, kind)
    return fmt
