"""What `zerotrain prepare` tokenizes: tokenizers, and inputs as a resumable stream of units.

A unit is one piece of a document: (payload bytes, last piece of its document?, (file, byte
offset) for error messages, position). The position is everything needed to restart the
stream at that unit, so an interrupted prepare resumes without re-reading what it wrote
(train/data/prepare_pool.py records it after each shard).

Text files are read in 4 MiB pieces cut after the last newline, exactly as the single-file
writer does; one difference only where a 4 MiB block has no newline at all: the cut then
backs off to a UTF-8 character boundary instead of splitting a character (the bytes, and so
byte-level tokens, are the same either way).

Local Hugging Face datasets (parquet, arrow, json/jsonl with --text-field) are read through
`datasets` from disk only (HF_DATASETS_OFFLINE=1, streaming): one record is one document.
`datasets` is imported late: its imports are slow and only this source needs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from zerotrain.train.errors import ConfigError, DataError

PIECE_BYTES = 4 << 20
DATASET_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json"}


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256
    separator = [10]  # "\n" between documents
    spec = None
    needs_text = False  # bytes are bytes: invalid UTF-8 is not an error for byte-level tokens

    def encode_batch(self, pieces: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(p, dtype=np.uint8) for p in pieces]


class HFTokenizer:
    """A local Hugging Face tokenizer directory (tokenizer.json / sentencepiece files); no network."""

    needs_text = True

    def __init__(self, path: str):
        import zerotrain.models.hub as hub
        d = hub.local_path(path, "data.tokenizer")  # a directory, or a Hub id's cached snapshot
        if not d.is_dir():
            raise ConfigError(f"--tokenizer {d} is not a directory; give a local Hugging Face tokenizer directory "
                              f"(the one holding tokenizer.json or tokenizer.model)")
        from transformers import AutoTokenizer  # late: seconds to import, and bytes need none of it
        try:
            self.tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer {d}: cannot load a tokenizer from it ({str(e).splitlines()[0][:200]}); "
                              f"it needs tokenizer.json (or tokenizer.model) and tokenizer_config.json") from None
        self.tok.model_max_length = 1 << 62  # we tokenize whole files, not model inputs: no length warning
        self.spec = str(d)
        self.name = str(d.resolve())
        self.vocab_size = len(self.tok)
        eos = self.tok.eos_token_id
        self.separator = [] if eos is None else [int(eos)]
        # Rust tokenizer when there is one: encode_batch runs on all cores (same ids as tok(text)).
        self.backend = getattr(self.tok, "backend_tokenizer", None)

    def encode_batch(self, pieces: list[bytes]) -> list[np.ndarray]:
        texts = [p.decode("utf-8", errors="replace") for p in pieces]
        if self.backend is not None:
            return [np.asarray(e.ids, dtype=np.int64) for e in self.backend.encode_batch(texts, add_special_tokens=False)]
        return [np.asarray(self.tok(t, add_special_tokens=False)["input_ids"], dtype=np.int64) for t in texts]


def make_tokenizer(spec: Optional[str]):
    return HFTokenizer(spec) if spec else ByteTokenizer()


def _utf8_cut(block: bytes) -> int:
    """The largest cut <= len(block) that does not split a UTF-8 character."""
    j = len(block) - 1
    while j > 0 and len(block) - j < 4 and block[j] & 0xC0 == 0x80:
        j -= 1
    lead = block[j]
    need = 4 if lead >= 0xF0 else 3 if lead >= 0xE0 else 2 if lead >= 0xC0 else 1
    return j if j + need > len(block) and j > 0 else len(block)


def text_units(files: list[Path], start: Optional[list] = None) -> Iterator[tuple]:
    """Units of text files from position `start` = [file index, next piece's offset, file offset]
    (carry = the bytes between the two offsets, as the reader holds them)."""
    f0, x0, p0 = start or (0, 0, 0)
    for fi in range(f0, len(files)):
        path = files[fi]
        x, fp = (x0, p0) if fi == f0 else (0, 0)
        try:
            with open(path, "rb") as f:
                f.seek(x)
                carry = f.read(fp - x)
                prev = None
                while True:
                    pos = [fi, x, fp]
                    block = f.read(PIECE_BYTES)
                    if not block:
                        break
                    fp += len(block)
                    block = carry + block
                    cut = block.rfind(b"\n") + 1 or _utf8_cut(block)
                    carry = block[cut:]
                    if prev is not None:
                        yield prev + (False,)
                    prev = (block[:cut], (str(path), x), pos)
                    x += cut
                if carry:
                    if prev is not None:
                        yield prev + (False,)
                    prev = (carry, (str(path), x), pos)
        except OSError as e:
            raise DataError(f"prepare: {path}: cannot read it ({e.strerror or e}) at byte {fp}") from None
        yield prev + (True,) if prev is not None else (b"", (str(path), 0), [fi, 0, 0], True)


def find_input_files(inputs: list[str], suffixes, what: str, named_flag: Optional[str] = None) -> list[Path]:
    """`prepare`'s inputs: named files, and the files with one of `suffixes` under named
    directories (sorted, hidden parts skipped). `named_flag`: a named file must have one of
    the suffixes too (else one line naming the flag); otherwise any named file is taken."""
    files = []
    for spec in inputs:
        p = Path(spec).expanduser()
        if p.is_file():
            if named_flag and p.suffix.lower() not in suffixes:
                raise ConfigError(f"prepare {named_flag}: {p} is not a {'/'.join(suffixes)} file")
            files.append(p)
        elif p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes
                            and not any(part.startswith(".") for part in f.relative_to(p).parts))
        else:
            raise DataError(f"prepare: input {p} does not exist")
    if not files:
        raise DataError(f"prepare: no {what} ({', '.join(suffixes)}) under {', '.join(inputs)}")
    return files


def find_dataset_files(inputs: list[str]) -> list[Path]:
    return find_input_files(inputs, DATASET_SUFFIXES, "dataset files", named_flag="--text-field")


def dataset_units(files: list[Path], field: str, start: Optional[list] = None) -> Iterator[tuple]:
    """One unit per record's `field`, from position [file index, record index, 0]."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"  # local files only: never the hub
    import datasets  # late: slow imports that only this source needs
    datasets.disable_progress_bars()
    f0, r0, _ = start or (0, 0, 0)
    for fi in range(f0, len(files)):
        path = files[fi]
        try:
            ds = datasets.load_dataset(DATASET_SUFFIXES[path.suffix.lower()], data_files=[str(path)], split="train",
                                       streaming=True)
            records = iter(ds)
            for ri, rec in enumerate(records):
                if fi == f0 and ri < r0:
                    continue
                if field not in rec:
                    raise DataError(f"prepare: {path}: record {ri} has no field {field!r} (fields: "
                                    f"{', '.join(sorted(rec)) or 'none'}); pass --text-field NAME")
                text = rec[field]
                if not isinstance(text, str):
                    raise DataError(f"prepare: {path}: record {ri}: field {field!r} is {type(text).__name__}, not text")
                yield text.encode("utf-8"), (str(path), None), [fi, ri, 0], True
        except DataError:
            raise
        except Exception as e:  # pyarrow/json errors: one line naming the file
            raise DataError(f"prepare: {path}: cannot read it as {DATASET_SUFFIXES[path.suffix.lower()]} "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
