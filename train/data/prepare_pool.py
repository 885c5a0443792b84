"""`zerotrain prepare --out DIR`: tokenize on every core into shards, resumably.

Parallel, deterministic: the main process reads units (train/data/prep_sources.py) in
order and sends batches of ~16 MiB to a process pool; results are consumed in submission
order (a bounded window of in-flight batches, so memory stays ~workers x 32 MiB whatever the
corpus size), so the shards are byte-identical for any number of workers.

Resumable: after each shard is complete (written to .tmp, fsynced, renamed) DIR/progress.json
records it and the stream position where the next shard starts. A re-run with the same
inputs (paths, sizes, mtimes, tokenizer, --shard-tokens) keeps the intact prefix of recorded
shards (one stat each), rewrites the rest and ends byte-identical to an uninterrupted run.
manifest.json is written last; its presence means the set is complete.

ZEROTRAIN_PREPARE_STOP_AFTER=K (for tests, train/testhooks.py) stops after K shards as an
interruption would.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from zerotrain.train import testhooks
from zerotrain.train.data import prep_sources
from zerotrain.train.data.shards import CHECKSUM, FORMAT, MANIFEST, VERSION, hasher
from zerotrain.train.errors import ConfigError, DataError

PROGRESS = "progress.json"
BATCH_BYTES = 16 << 20
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MiB of uint16 per shard: few files, cheap to map, resume loses < 1 shard


class Stopped(Exception):
    """ZEROTRAIN_PREPARE_STOP_AFTER reached (a deterministic interruption, for tests)."""


# ----------------------------------------------------------------------------- encoding

_TOKENIZER = None


def _init_worker(spec):
    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism
    _TOKENIZER = prep_sources.make_tokenizer(spec)


def encode(tokenizer, batch: list[tuple], dtype) -> list[tuple[np.ndarray, int]]:
    """(ids + separator if the document ends, content token count) per unit, as `dtype`."""
    if tokenizer.needs_text:
        for payload, (path, offset), _, _ in batch:
            if offset is not None:
                try:
                    payload.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"prepare: {path}: invalid UTF-8 at byte {offset + e.start} (the tokenizer needs "
                                    f"text; convert it, e.g. iconv -f latin1 -t utf-8, or leave the file out)") from None
    sep = np.asarray(tokenizer.separator, dtype=dtype)
    out = []
    for (_, _, _, last), ids in zip(batch, tokenizer.encode_batch([u[0] for u in batch])):
        ids = np.asarray(ids).astype(dtype)
        out.append((np.concatenate([ids, sep]) if last and len(sep) else ids, len(ids)))
    return out


def _work(batch, dtype):
    return encode(_TOKENIZER, batch, dtype)


def _batches(units: Iterator[tuple]) -> Iterator[list[tuple]]:
    batch, size = [], 0
    for u in units:
        batch.append(u)
        size += len(u[0])
        if size >= BATCH_BYTES or len(batch) >= 1024:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encoded(units: Iterator[tuple], tokenizer, workers: int, dtype) -> Iterator[tuple[tuple, np.ndarray, int]]:
    """(unit, ids, content tokens) in input order; `workers` processes (1: in this process)."""
    if workers <= 1:
        for batch in _batches(units):
            yield from ((u, ids, n) for u, (ids, n) in zip(batch, encode(tokenizer, batch, dtype)))
        return
    # fork where there is one: spawn re-imports torch and the caller's modules per worker
    # (slow). Workers only run numpy and the tokenizer, whose own
    # threads are off in them (TOKENIZERS_PARALLELISM=false), so no lock held by a parent
    # thread is touched across the fork.
    ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec,)) as pool:
        window = deque()
        batches = _batches(units)
        for batch in batches:
            window.append((batch, pool.apply_async(_work, (batch, dtype))))
            if len(window) >= 2 * workers:
                b, r = window.popleft()
                yield from ((u, ids, n) for u, (ids, n) in zip(b, r.get()))
        while window:
            b, r = window.popleft()
            yield from ((u, ids, n) for u, (ids, n) in zip(b, r.get()))


# ----------------------------------------------------------------------------- progress


class Meter:
    """tokens/s on stderr: a \\r line on a terminal, a line every 10 s otherwise (logs)."""

    def __init__(self, what: str, start_tokens: int = 0):
        self.what, self.base = what, start_tokens
        self.t0 = self.last = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.every = 0.5 if self.tty else 10.0

    def __call__(self, tokens: int, shards: int, final: bool = False):
        now = time.perf_counter()
        if not final and now - self.last < self.every:
            return
        self.last = now
        rate = (tokens - self.base) / max(now - self.t0, 1e-9)
        line = f"  {self.what}: {shards} shards, {tokens / 1e6:.1f}M tokens, {rate:,.0f} tokens/s"
        if self.tty:
            print("\r" + line, end="\n" if final else "", file=sys.stderr, flush=True)
        elif not final:
            print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- shards


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


class ShardWriter:
    """Cuts a token stream into files of exactly `shard_tokens` tokens (the last one shorter)."""

    def __init__(self, out: Path, prefix: str, dtype, shard_tokens: int, done: list[dict],
                 on_shard: Callable[[dict], None]):
        self.out, self.prefix, self.dtype, self.cap = out, prefix, dtype, shard_tokens
        self.entries, self.on_shard = list(done), on_shard
        self.f = None

    def _open(self):
        self.name = f"{self.prefix}_{len(self.entries):05d}.bin"
        self.f = open(self.out / (self.name + ".tmp"), "wb")
        self.n, self.top, self.h = 0, 0, hasher()

    def write(self, ids: np.ndarray, resume_at: Callable[[int], dict]) -> None:
        """Append ids; resume_at(k) = the stream position after the first k of them."""
        i = 0
        while i < len(ids):
            if self.f is None:
                self._open()
            part = ids[i: i + self.cap - self.n]
            b = part.tobytes()
            self.f.write(b)
            self.h.update(b)
            self.n += len(part)
            self.top = max(self.top, int(part.max()))
            i += len(part)
            if self.n == self.cap:
                self.close(resume_at(i))

    def close(self, resume: Optional[dict]) -> None:
        if self.f is None:
            return
        self.f.flush()
        os.fsync(self.f.fileno())  # a renamed shard is a complete shard, even after a power cut
        self.f.close()
        self.f = None
        os.replace(self.out / (self.name + ".tmp"), self.out / self.name)
        entry = {"file": self.name, "num_tokens": self.n, "max_token": self.top,
                 "bytes": self.n * np.dtype(self.dtype).itemsize, "sha256": self.h.hexdigest(), "resume": resume}
        self.entries.append(entry)
        self.on_shard(entry)


def fingerprint(files: list[Path], val: list[Path], tokenizer, text_field, shard_tokens: int) -> dict:
    def stat(fs):
        return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in fs]
    return {"version": VERSION, "inputs": stat(files), "val": stat(val), "tokenizer": tokenizer.name,
            "text_field": text_field, "shard_tokens": shard_tokens}


def _intact(out: Path, entries: list[dict]) -> list[dict]:
    """The recorded shards that are still there at their recorded size (a prefix)."""
    kept = []
    for e in entries:
        p = out / e["file"]
        if not p.is_file() or p.stat().st_size != e["bytes"]:
            break
        kept.append(e)
    return kept


def prepare_shards(files: list[Path], val: list[Path], tokenizer, out: Path, shard_tokens: int, workers: int,
                   text_field: Optional[str] = None) -> dict:
    """Tokenize into out/shard_*.bin (+ out/val_*.bin) and write out/manifest.json; resumes."""
    if shard_tokens < 2:
        raise ConfigError(f"--shard-tokens {shard_tokens}: a shard needs at least 2 tokens (default {DEFAULT_SHARD_TOKENS})")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; a sharded prepare writes a directory (or use --out NAME.bin)")
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    fp = fingerprint(files, val, tokenizer, text_field, shard_tokens)
    manifest, progress = out / MANIFEST, out / PROGRESS
    for existing in (manifest, progress):
        if existing.is_file():
            try:
                old = json.loads(existing.read_text()).get("source")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                old = None
            if old != fp:
                raise DataError(f"--out {out} already holds a prepared set ({existing.name}) of other inputs or "
                                f"settings; choose another --out or delete {out}")
    if manifest.is_file():
        meta = json.loads(manifest.read_text())
        return {**meta, "up_to_date": True}
    state = json.loads(progress.read_text()) if progress.is_file() else {"source": fp, "phases": {}}
    testhooks.load()  # ZEROTRAIN_PREPARE_STOP_AFTER as set now: tests run several prepares in one process
    written = [0]
    totals = {}
    for phase, inputs in (("shards", files), ("val", val)):
        if not inputs:
            continue
        rec = state["phases"].setdefault(phase, {"entries": [], "done": False})
        intact = _intact(out, rec["entries"])
        if len(intact) < len(rec["entries"]):  # a shard deleted or cut short: redo from the last intact one
            rec.update(entries=intact, done=False)
        if not rec["done"]:
            _run_phase(phase, inputs, rec, state, tokenizer, out, dtype, shard_tokens, workers, text_field,
                       progress, written)
        totals[phase] = rec
    meta = manifest_meta(dtype, tokenizer.vocab_size, tokenizer.name, shard_tokens,
                         {phase: rec["entries"] for phase, rec in totals.items()}, totals["shards"]["files"], fp,
                         separator=tokenizer.separator)
    _write_json(manifest, meta)
    progress.unlink(missing_ok=True)
    return meta


def manifest_meta(dtype, vocab_size: int, tokenizer_name: str, shard_tokens: int, phases: dict[str, list[dict]],
                  files: int, source, separator=None) -> dict:
    """manifest.json's content for the ShardWriter entries of each phase ("shards", "val")
    (also what bench/data_scale.py writes for its generated corpora)."""
    meta = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name, "vocab_size": vocab_size,
            "tokenizer": tokenizer_name, "checksum": CHECKSUM, "shard_tokens": shard_tokens}
    meta["num_tokens"] = sum(e["num_tokens"] for e in phases["shards"])
    meta["max_token"] = max(e["max_token"] for entries in phases.values() for e in entries)
    meta["files"] = files
    for phase, entries in phases.items():
        meta[phase] = [{k: v for k, v in e.items() if k != "resume"} for e in entries]
    meta["source"] = source
    if separator is not None:  # the ids that end each document (data.document_mask reads the EOS from it)
        meta["separator"] = [int(t) for t in separator]
    return meta


def write_manifest(out: Path, meta: dict) -> None:
    """Written last and atomically: its presence means the set is complete."""
    _write_json(out / MANIFEST, meta)


def _run_phase(phase, inputs, rec, state, tokenizer, out, dtype, shard_tokens, workers, text_field, progress,
               written):
    prefix = "shard" if phase == "shards" else "val"
    last = rec["entries"][-1]["resume"] if rec["entries"] else None
    start, skip = (last.get("pos"), last.get("skip", 0)) if last else (None, 0)
    counts = {"files": last["files"] if last else 0, "content": last["content"] if last else 0}
    if last and last.get("end"):  # stopped right after the phase's final (short) shard
        rec.update(done=True, files=counts["files"])
        _write_json(progress, state)
        return
    for stale in out.glob(f"{prefix}_*.bin*"):  # shards past the intact prefix, half-written .tmp files
        if stale.name not in {e["file"] for e in rec["entries"]}:
            stale.unlink()
    tokens = sum(e["num_tokens"] for e in rec["entries"])
    meter = Meter(f"{phase if phase == 'val' else 'train'} -> {out}", tokens)

    def on_shard(entry):
        rec["entries"] = writer.entries
        _write_json(progress, state)
        written[0] += 1
        if testhooks.fire("shard_written", shards=written[0]):
            raise Stopped(f"stopped after {written[0]} shards (ZEROTRAIN_PREPARE_STOP_AFTER); re-run to resume")

    writer = ShardWriter(out, prefix, dtype, shard_tokens, rec["entries"], on_shard)
    units = (prep_sources.dataset_units(inputs, text_field, start) if text_field
             else prep_sources.text_units(inputs, start))
    for (_, _, pos, doc_end), ids, n_content in encoded(units, tokenizer, workers, dtype):
        # The first unit after a resume: its first `skip` tokens are already in the last shard.
        done_before, ids, skip = skip, ids[skip:], 0
        writer.write(ids, lambda k, pos=pos, d=done_before: {"pos": pos, "skip": d + k, **counts})
        # Counted once the unit is fully written (a resume record holds the counts before it).
        counts["content"] += n_content
        counts["files"] += bool(doc_end)
        tokens += len(ids)
        meter(tokens, len(writer.entries))
    writer.close({"end": True, **counts})
    meter(tokens, len(writer.entries), final=True)
    if counts["content"] == 0:
        raise DataError(f"prepare: the {'--val ' if phase == 'val' else ''}input files are empty")
    rec.update(entries=writer.entries, done=True, files=counts["files"])
    _write_json(progress, state)
