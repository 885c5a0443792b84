"""`zerotrain prepare`: text files -> a token file for data.kind = tokens.

    zerotrain prepare docs/ notes.txt --out data/corpus.bin                 # byte-level (vocab 256)
    zerotrain prepare corpus/ --out data/corpus.bin --tokenizer models/my-llama   # local HF tokenizer
    zerotrain prepare train/ --val held_out/ --out data/corpus.bin          # + data/corpus.val.bin

Streams: files are read in 4 MiB pieces (cut at line ends) and tokenized ~16 MiB at a
time, so corpora larger than memory work. (A file over 4 MiB is thus tokenized piecewise:
at each cut, once per 4 MiB, the ids can differ from tokenizing the whole file at once.)
Documents (files) are separated by the tokenizer's EOS token (a newline byte for the
byte-level tokenizer). The sidecar data/corpus.json records
dtype, vocab size, token count and the largest id, which training checks in O(1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from train.data.tokens import FORMAT, sidecar_path, val_path
from train.errors import ConfigError, DataError, user_errors

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".tex", ".c", ".h", ".js")
PIECE_BYTES = 4 << 20


def find_text_files(inputs: list[str], suffixes=TEXT_SUFFIXES) -> list[Path]:
    files = []
    for spec in inputs:
        p = Path(spec).expanduser()
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes
                            and not any(part.startswith(".") for part in f.relative_to(p).parts))
        else:
            raise DataError(f"prepare: input {p} does not exist")
    if not files:
        raise DataError(f"prepare: no text files ({', '.join(suffixes)}) under {', '.join(inputs)}")
    return files


def _pieces(path: Path) -> Iterator[bytes]:
    """The file in ~4 MiB pieces cut after a newline (so no word is split between pieces)."""
    with open(path, "rb") as f:
        carry = b""
        while True:
            block = f.read(PIECE_BYTES)
            if not block:
                break
            block = carry + block
            cut = block.rfind(b"\n") + 1
            if cut == 0:  # no newline at all in 4 MiB: cut anyway
                cut = len(block)
            carry = block[cut:]
            yield block[:cut]
        if carry:
            yield carry


def _documents(files: Iterable[Path]) -> Iterator[tuple[bytes, bool]]:
    """(piece, last piece of its file?) for every piece of every file, in order."""
    for path in files:
        prev = None
        for piece in _pieces(path):
            if prev is not None:
                yield prev, False
            prev = piece
        yield prev or b"", True


class ByteTokenizer:
    name = "bytes"
    vocab_size = 256
    separator = [10]  # "\n" between documents

    def encode_batch(self, pieces: list[bytes]) -> list[np.ndarray]:
        return [np.frombuffer(p, dtype=np.uint8) for p in pieces]


class HFTokenizer:
    """A local Hugging Face tokenizer directory (tokenizer.json / sentencepiece files); no network."""

    def __init__(self, path: str):
        d = Path(path).expanduser()
        if not d.is_dir():
            raise ConfigError(f"--tokenizer {d} is not a directory; give a local Hugging Face tokenizer directory "
                              f"(the one holding tokenizer.json or tokenizer.model)")
        from transformers import AutoTokenizer
        try:
            self.tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer {d}: cannot load a tokenizer from it ({str(e).splitlines()[0][:200]}); "
                              f"it needs tokenizer.json (or tokenizer.model) and tokenizer_config.json") from None
        self.tok.model_max_length = 1 << 62  # we tokenize whole files, not model inputs: no length warning
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


def write_tokens(files: Iterable[Path], tokenizer, out: Path, progress: Callable[[str], None] = lambda s: None,
                 batch_bytes: int = 4 * PIECE_BYTES) -> dict:
    """Tokenize `files` into `out` (+ sidecar), atomically: a crash leaves no half file.
    Pieces are tokenized in batches of ~16 MiB (many small files: one call, all cores)."""
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    n, top, n_files, content = 0, 0, 0, 0
    sep = np.asarray(tokenizer.separator, dtype=dtype)
    with open(tmp, "wb") as f:
        def flush(batch):
            nonlocal n, top, n_files, content
            for (_, last), ids in zip(batch, tokenizer.encode_batch([p for p, _ in batch])):
                if len(ids):
                    top = max(top, int(ids.max()))
                    ids.astype(dtype).tofile(f)
                    n += len(ids)
                    content += len(ids)
                if last:
                    if len(sep):
                        sep.tofile(f)
                        n += len(sep)
                        top = max(top, int(sep.max()))
                    n_files += 1

        batch, size = [], 0
        for piece, last in _documents(files):
            batch.append((piece, last))
            size += len(piece)
            if size >= batch_bytes or len(batch) >= 1024:
                flush(batch)
                progress(f"{n_files} files, {n / 1e6:.1f}M tokens")
                batch, size = [], 0
        if batch:
            flush(batch)
    if content == 0:
        tmp.unlink()
        raise DataError("prepare: the input files are empty")
    meta = {"format": FORMAT, "version": 1, "dtype": np.dtype(dtype).name, "vocab_size": tokenizer.vocab_size,
            "num_tokens": n, "max_token": top, "tokenizer": tokenizer.name, "files": n_files}
    side_tmp = sidecar_path(out).with_name(sidecar_path(out).name + ".tmp")
    side_tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out)
    os.replace(side_tmp, sidecar_path(out))
    return meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotrain prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("inputs", nargs="+", help="text files or directories (searched for " + " ".join(TEXT_SUFFIXES) + ")")
    p.add_argument("--out", required=True, help="output token file, e.g. data/corpus.bin (sidecar: data/corpus.json)")
    p.add_argument("--val", nargs="+", default=None, metavar="PATH",
                   help="held-out text files/directories -> <out>.val.bin (else training holds out data.val_fraction)")
    p.add_argument("--tokenizer", default=None,
                   help="local Hugging Face tokenizer directory (default: bytes, vocab 256)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    a = p.parse_args(argv)
    with user_errors(a.debug):
        out = Path(a.out).expanduser()
        if out.suffix != ".bin":
            raise ConfigError(f"--out {out}: use a .bin name (its sidecar is <name>.json, validation <name>.val.bin)")
        tokenizer = HFTokenizer(a.tokenizer) if a.tokenizer else ByteTokenizer()
        jobs = [(find_text_files(a.inputs), out)]
        if a.val:
            jobs.append((find_text_files(a.val), val_path(out)))
        else:
            for stale in (val_path(out), sidecar_path(val_path(out))):
                if stale.exists():  # a val split of an earlier corpus would be picked up by training
                    stale.unlink()
                    print(f"removed {stale} (left from an earlier prepare; training holds out data.val_fraction)")
        for files, target in jobs:
            t0 = time.perf_counter()
            meta = write_tokens(files, tokenizer, target, lambda s: print(f"  {s}", file=sys.stderr, flush=True))
            print(f"wrote {target}: {meta['num_tokens']:,} {meta['dtype']} tokens from {meta['files']} files "
                  f"(vocab {meta['vocab_size']}, max id {meta['max_token']}, tokenizer {meta['tokenizer']}) "
                  f"in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0

