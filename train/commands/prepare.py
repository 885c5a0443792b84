"""`zerotrain prepare`: text files -> a token file for data.kind = tokens; with --sft, JSONL
instruction records -> a prepared set for data.kind = sft.

    zerotrain prepare docs/ notes.txt --out data/corpus.bin                 # byte-level (vocab 256)
    zerotrain prepare corpus/ --out data/corpus.bin --tokenizer models/my-llama   # local HF tokenizer
    zerotrain prepare train/ --val held_out/ --out data/corpus.bin          # + data/corpus.val.bin
    zerotrain prepare --sft records.jsonl --out data/sft.bin --tokenizer models/my-llama  # sft, tokenized once
    zerotrain prepare corpus/ --out data/corpus --tokenizer models/my-llama  # shards + manifest, all cores
    zerotrain prepare data.parquet --text-field text --out data/corpus      # local HF dataset files
    zerotrain prepare --verify data/corpus                                  # sha256 of every shard
    zerotrain prepare --reference --config examples/dpo.yaml --strategy ds_configs/ddp.json  # DPO reference, once

--out DIR (no .bin suffix): shards of --shard-tokens tokens + DIR/manifest.json, tokenized on
--workers processes (identical shards for any number), resumable after an interruption by
re-running the same command (train/data/prepare_pool.py, train/data/shards.py). Training checks
shard sizes at start; --verify hashes them. With a tokenizer, invalid UTF-8 is an error naming
the file and byte; byte-level takes any bytes.

--sft: one JSONL file of {"prompt", "response"} / {"messages"} records is tokenized exactly as
data.kind sft does at start-up (the same code), but once: training with data.path
data/sft.bin memory-maps it instead of every rank tokenizing every record (measured:
docs/workloads.md "Instruction data"). Records are stored whole with a trained flag per token,
so data.seq_len stays a training-time choice. --val FILE, else a sibling <records>.val.jsonl, gives
data/sft.val.bin. The sidecar data/sft.json records the tokenizer (by content), whether its
chat template was used (--no-chat-template = data.chat_template false) and the source's size
and sha256: training refuses a set made with another tokenizer or template setting, or from
a source that has changed since. A bad record stops prepare with one line naming file:line
(exit 2) and leaves no output. Layout: train/data/sft_file.py.

--reference --config RUN.yaml [--strategy FILE.json] [--section.key VALUE ...]: for a run with
data.kind preference, the reference log-probabilities of every record of data.path (and of its
<name>.val.jsonl), from the run's model at its starting weights (model.name built as the run
builds it, train.seed; the base model under model.lora), on one device (CUDA if there is one),
written beside each file as <name>.reference.safetensors (train/data/reference.py). They are
computed the way the run's policy computes its own at step 1 under the run's strategy file and
precision (DDP bf16: autocast with fp32 outputs; ZeRO bf16/fp16: the model in 16 bits; FSDP2
bf16: bf16 parameters; fp32: fp32 under every backend), so a bf16 run starts with rewards
exactly 0 and the loss exactly log 2. The strategy file is the run's: --strategy (--ds-config is
the same flag), else the run file's distributed.ds_config, else the one a run without either
takes on this machine; make the file with the strategy file the run will use (not auto). The
file records that form, and a run whose strategy file computes otherwise refuses it in one line.
A run with train.dpo.reference precomputed then reads them instead of running a reference model.
Re-running with nothing changed does nothing; a file made for other data, tokenizer, seq_len,
model, seed or strategy precision is refused by training in one line.

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

from zerotrain.train.data import prepare_pool, prep_sources
from zerotrain.train.data.prep_sources import ByteTokenizer, HFTokenizer  # noqa: F401 (moved there; importable from here)
from zerotrain.train.data.shards import Corpus
from zerotrain.train.data.tokens import FORMAT, sidecar_path, val_path
from zerotrain.train.errors import ConfigError, DataError, user_errors
from zerotrain.train.launch import device_env

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".csv", ".html", ".tex", ".c", ".h", ".js")
PIECE_BYTES = 4 << 20


def find_text_files(inputs: list[str], suffixes=TEXT_SUFFIXES) -> list[Path]:
    return prep_sources.find_input_files(inputs, suffixes, "text files")


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
            "num_tokens": n, "max_token": top, "tokenizer": tokenizer.name, "files": n_files,
            "separator": [int(t) for t in tokenizer.separator]}  # what ends each document (data.document_mask)
    side_tmp = sidecar_path(out).with_name(sidecar_path(out).name + ".tmp")
    side_tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, out)
    os.replace(side_tmp, sidecar_path(out))
    return meta


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--reference" in argv and not {"-h", "--help"} & set(argv):  # (with --help: this command's help, below)
        rest = [a for a in argv if a != "--reference"]
        with user_errors("--debug" in rest):
            return prepare_reference([a for a in rest if a != "--debug"])
    p = argparse.ArgumentParser(prog="zerotrain prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("inputs", nargs="*", help="text files or directories (searched for " + " ".join(TEXT_SUFFIXES) +
                   "); with --sft one JSONL file of instruction records; with --text-field parquet/arrow/jsonl files")
    p.add_argument("--out", help="output token file, e.g. data/corpus.bin (sidecar: data/corpus.json), or a "
                                 "directory (no .bin suffix) for a sharded set: DIR/shard_*.bin + DIR/manifest.json")
    p.add_argument("--shard-tokens", type=int, default=None,
                   help=f"with --out DIR: tokens per shard (default {prepare_pool.DEFAULT_SHARD_TOKENS:,} = 2^27)")
    p.add_argument("--workers", type=int, default=None,
                   help="with --out DIR: tokenizer processes (default: the CPUs this process may use)")
    p.add_argument("--text-field", default=None, metavar="NAME",
                   help="the inputs are local Hugging Face dataset files (.parquet, .arrow, .jsonl/.json, or "
                        "directories of them); tokenize each record's NAME field (with --out DIR)")
    p.add_argument("--verify", metavar="DIR", default=None,
                   help="hash every shard of a sharded set against its manifest (the check training skips: "
                        "it only compares sizes) and exit")
    p.add_argument("--val", nargs="+", default=None, metavar="PATH",
                   help="held-out text files/directories -> <out>.val.bin (else training holds out data.val_fraction); "
                        "with --sft one JSONL file (default: a sibling <input>.val.jsonl if there is one)")
    p.add_argument("--tokenizer", default=None,
                   help="local Hugging Face tokenizer directory (default: bytes, vocab 256)")
    p.add_argument("--sft", action="store_true",
                   help="the input is JSONL instruction records: write a prepared set for data.kind sft "
                        "(<out>, <out stem>.trained.bin/.offsets.bin/.index.bin, <out stem>.json)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="with --sft: do not use the tokenizer's chat template (for runs with data.chat_template false)")
    p.add_argument("--reference", action="store_true",
                   help="with --config RUN.yaml [--strategy FILE.json] [--section.key VALUE ...] (and no inputs): a DPO "
                        "run's reference log-probs, computed as the run's strategy file computes (--strategy, alias "
                        "--ds-config, else the run file's distributed.ds_config); see below")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    a = p.parse_args(argv)
    with user_errors(a.debug):
        if a.verify:
            if a.inputs or a.out:
                raise ConfigError("--verify DIR checks an existing set: give no inputs or --out with it")
            return verify(a)
        if a.sft and (a.shard_tokens or a.workers or a.text_field):
            raise ConfigError("--shard-tokens/--workers/--text-field apply to a sharded set, not --sft")
        if not a.inputs or not a.out:
            raise ConfigError("prepare needs input files and --out (or --verify DIR)")
        _fetch_tokenizer(a.tokenizer)
        if a.sft:
            return prepare_sft(a)
        if a.no_chat_template:
            raise ConfigError("--no-chat-template applies to --sft (instruction records) only")
        out = Path(a.out).expanduser()
        if out.is_dir() or not out.suffix:
            return prepare_sharded(a, out)
        if out.suffix != ".bin":
            raise ConfigError(f"--out {out}: use a .bin name for one token file (its sidecar is <name>.json, "
                              f"validation <name>.val.bin), or a directory name without a suffix for shards")
        for flag, value in (("--shard-tokens", a.shard_tokens), ("--workers", a.workers), ("--text-field", a.text_field)):
            if value is not None:
                raise ConfigError(f"{flag} applies to a sharded set (--out DIR, no .bin suffix); --out {out} is one file")
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


# ----------------------------------------------------------------------------- sharded (--out DIR)

def hub_id(name: str) -> bool:
    import zerotrain.models.hub as hub
    return hub.parse(name) is not None


def _fetch_tokenizer(name) -> None:
    """--tokenizer as a Hub id (org/name[@revision]): into huggingface_hub's cache first (this one
    process; HF_HUB_OFFLINE: the cache only), then read from there like a local directory."""
    import zerotrain.models.hub as hub
    h = hub.parse(name) if name else None
    if h is not None and not hub._offline():
        hub.download(h, "--tokenizer")


def prepare_sharded(a, out: Path) -> int:
    """--out DIR: shards + manifest on every core, resumable (train/data/prepare_pool.py)."""
    for flag, value in (("--sft", a.sft), ("--no-chat-template", a.no_chat_template)):
        if value:
            raise ConfigError(f"{flag} writes one .bin file: give --out NAME.bin")
    if a.workers is not None and a.workers < 1:
        raise ConfigError(f"--workers {a.workers}: give 1 or more")
    tokenizer = prep_sources.make_tokenizer(a.tokenizer)
    find = (lambda specs: prep_sources.find_dataset_files(specs)) if a.text_field else find_text_files
    if not a.text_field:
        odd = [s for s in a.inputs + (a.val or []) if Path(s).suffix.lower() in (".parquet", ".arrow")]
        if odd:
            raise ConfigError(f"{odd[0]} is a dataset file: pass --text-field NAME (the column holding the text)")
    files, val = find(a.inputs), find(a.val) if a.val else []
    workers = a.workers or device_env.cores()
    t0 = time.perf_counter()
    try:
        meta = prepare_pool.prepare_shards(files, val, tokenizer, out, a.shard_tokens or prepare_pool.DEFAULT_SHARD_TOKENS,
                                           workers, a.text_field)
    except prepare_pool.Stopped as e:
        print(f"prepare: {e}", file=sys.stderr, flush=True)
        return 3
    if meta.get("up_to_date"):
        print(f"{out} is complete for these inputs: nothing to do ({len(meta['shards'])} shards, "
              f"{meta['num_tokens']:,} tokens)", flush=True)
        return 0
    val_note = f" (+ {len(meta['val'])} val shards)" if "val" in meta else ""
    print(f"wrote {out}: {len(meta['shards'])} shards, {meta['num_tokens']:,} {meta['dtype']} tokens from "
          f"{meta['files']} {'records' if a.text_field else 'files'}{val_note} "
          f"(vocab {meta['vocab_size']}, max id {meta['max_token']}, tokenizer {meta['tokenizer']}, {workers} workers) "
          f"in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


def verify(a) -> int:
    """--verify DIR: every shard's sha256 against the manifest (sizes alone are checked at training start)."""
    t0 = time.perf_counter()
    corpus = Corpus(Path(a.verify).expanduser())
    n = corpus.verify()
    dt = time.perf_counter() - t0
    print(f"{corpus.dir}: {len(corpus.shards)} shards ok ({n / 1e6:.1f} MB hashed in {dt:.1f}s)", flush=True)
    return 0


# ----------------------------------------------------------------------------- --sft

class Rate:
    """A progress line at most every `every` seconds: records, tokens and their rates."""

    def __init__(self, every: float = 2.0):
        self.t0 = self.last = time.perf_counter()
        self.every = every

    def line(self, records: int, tokens: int) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return f"{records:,} records, {tokens / 1e6:.2f}M tokens, {records / dt:,.0f} records/s, {tokens / dt:,.0f} tokens/s"

    def __call__(self, records: int, tokens: int):
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            print(f"  {self.line(records, tokens)}", file=sys.stderr, flush=True)


def _sft_file(spec: str, what: str) -> Path:
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"prepare --sft: {what} {path} is not a file (--sft takes one JSONL file of records)")
    return path


def prepare_sft(a) -> int:
    """`prepare --sft`: one JSONL file (+ its validation file) -> prepared sets (train/data/sft_file.py)."""
    import zerotrain.train.data.sft as sft  # late: the text path needs neither (nor torch, which sft imports)
    import zerotrain.train.data.sft_file as sft_file
    out = Path(a.out).expanduser()
    if out.suffix != ".bin":
        raise ConfigError(f"--out {out}: use a .bin name (data.path for data.kind sft; sidecar <name>.json)")
    if len(a.inputs) != 1 or (a.val and len(a.val) != 1):
        raise ConfigError("prepare --sft takes one JSONL file (and at most one --val file): file:line errors and "
                          "the staleness check name a single source")
    source = _sft_file(a.inputs[0], "input")
    val = _sft_file(a.val[0], "--val") if a.val else sft.val_path(source) if sft.val_path(source).is_file() else None
    enc = sft.hf_encoder(a.tokenizer, not a.no_chat_template) if a.tokenizer else sft.byte_encoder()
    meta = {"vocab_size": enc.vocab_size,
            "tokenizer": "bytes" if enc.name == "bytes" else enc.name if hub_id(enc.name) else
                         str(Path(enc.name).expanduser().resolve()),
            "tokenizer_sha256": enc.identity(), "chat_template": enc.render is not None}
    if val is None:
        for stale in sft_file.parts(sft_file.val_path(out)).values():
            if stale.exists():  # a val split of an earlier set would be picked up by training
                stale.unlink()
                print(f"removed {stale} (left from an earlier prepare; training holds out data.val_fraction)")
    for src, target in [(source, out)] + ([(val, sft_file.val_path(out))] if val else []):
        rate = Rate()
        side = sft_file.write(src, target, lambda lines: sft.encoded_records(lines, src, enc), enc.vocab_size, meta,
                              rate)
        print(f"wrote {target}: {side['records']:,} records, {side['num_tokens']:,} {side['dtype']} tokens "
              f"({side['trained_tokens']:,} trained) from {src} (tokenizer {side['tokenizer']}, chat template "
              f"{'yes' if side['chat_template'] else 'no'}) in {time.perf_counter() - rate.t0:.1f}s: "
              f"{rate.line(side['records'], side['num_tokens'])}", flush=True)
    return 0


# ----------------------------------------------------------------------------- --reference

REFERENCE_CHUNK = 4096  # records per commit of the partial file (a multiple of the 16 pairs a forward takes)


def _reference_in_chunks(workload, pairs, device, out: Path, want: dict):
    """Every record's reference log-probs, committed to <out>.partial.safetensors every
    REFERENCE_CHUNK records: an interrupted `prepare --reference` resumes from the last commit
    (same model, seed and data: the identity is checked), and its values are those of one pass,
    since the forwards start at the same multiples of 16 records."""
    import numpy as np

    from zerotrain.models.preference import dataset_reference_logps
    from zerotrain.train.data import reference
    partial = reference.partial_path(out)
    chosen, rejected = reference.read_partial(partial, want, pairs.lines)
    if len(chosen):
        print(f"resuming {out} from {partial}: {len(chosen):,} of {len(pairs):,} records already done", flush=True)
    while len(chosen) < len(pairs):
        c, r = dataset_reference_logps(workload, pairs, device, first=len(chosen),
                                       stop=len(chosen) + REFERENCE_CHUNK)
        chosen, rejected = np.concatenate([chosen, c.numpy()]), np.concatenate([rejected, r.numpy()])
        if len(chosen) < len(pairs):
            reference.write(partial, pairs.lines[:len(chosen)], chosen, rejected, want)
    return chosen, rejected


def prepare_reference(argv: list[str]) -> int:
    """`prepare --reference --config RUN.yaml [--strategy FILE.json] [overrides]`: the reference
    log-probs of a DPO run's pairs (train/data/reference.py), computed once with the run's model at
    its starting weights, as the run's strategy file makes it compute."""
    import dataclasses

    import torch
    from accelerate.utils import set_seed

    from zerotrain.models import build_workload, resolve
    from zerotrain.train.args import parse_train_args
    from zerotrain.train.config.loader import load_config
    from zerotrain.train.data import build_data, reference
    from zerotrain.train.data.preference import read_pairs
    from zerotrain.train.data.sequence_length import resolve_seq_len
    from zerotrain.train.data.sft import byte_encoder, hf_encoder, val_path
    from zerotrain.train.training.preference_setup import reference_identity

    a = parse_train_args(argv)
    cfg = load_config(a.config, a.overrides)
    from zerotrain.train.launch import hub_fetch
    hub_fetch.fetch(cfg, 0)  # Hub ids into the cache (one process here)
    if cfg.data.kind != "preference":
        raise ConfigError("prepare --reference: the run's data.kind must be preference (with train.objective dpo)")
    from zerotrain.train.data.records import is_table_spec
    if cfg.data.path and is_table_spec(cfg.data.path):
        raise ConfigError(f"prepare --reference: data.path {cfg.data.path} is not one JSONL file, and the reference "
                          f"file is keyed by a JSONL file's lines; write the records as one .jsonl file, or train "
                          f"with train.dpo.reference live")
    if cfg.model.init_from:
        raise ConfigError("prepare --reference computes with the model as built, before model.init_from is loaded; "
                          "export those weights as an hf: directory and name it in model.name")
    spec = resolve(cfg.model)
    seq_len = resolve_seq_len(cfg, spec)
    tokenizer = cfg.data.tokenizer or (spec.name[3:] if spec.family == "hf" else None)
    bundle = build_data(cfg.data, seq_len, cfg.train.seed, tokenizer)
    enc = hf_encoder(tokenizer, cfg.data.chat_template) if tokenizer else byte_encoder()
    source = Path(cfg.data.path).expanduser()
    sources = [source] + ([val_path(source)] if val_path(source).is_file() and val_path(source) != source else [])
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    strategy = _reference_strategy(a.ds_config, cfg, device)
    compute = strategy.compute_form(device.type)
    workload = None
    for src in sources:
        t0 = time.perf_counter()
        pairs, _, _ = read_pairs(src, enc, seq_len)
        if pairs is None:
            continue
        want = reference_identity(cfg, spec, seq_len, bundle, src, compute)
        out = reference.reference_path(src)
        if out.is_file():
            try:
                reference.load(src, want, pairs.lines)
                print(f"{out} is up to date for {src}: nothing to do ({len(pairs)} records)", flush=True)
                continue
            except DataError:
                pass  # stale: made again
        if workload is None:  # the run's starting weights: its seed, then the model as build_model builds it
            base = resolve(dataclasses.replace(cfg.model, lora=None)) if cfg.model.lora is not None else spec
            set_seed(cfg.train.seed)
            workload = build_workload(base, bundle)
            # as the run's policy computes at step 1 under its strategy file (in bf16: its rewards exactly 0)
            workload.model = strategy.frozen_like_policy(workload.model.to(device))
        chosen, rejected = _reference_in_chunks(workload, pairs, device, out, want)
        reference.write(out, pairs.lines, chosen, rejected, want)
        reference.partial_path(out).unlink(missing_ok=True)
        print(f"wrote {out}: reference log-probs of {len(pairs):,} records of {src} (model {cfg.model.name}"
              f"{', base without adapters' if cfg.model.lora is not None else ''}, seq_len {seq_len}, computed in "
              f"{compute} as {strategy.path} runs) in {time.perf_counter() - t0:.1f}s", flush=True)
    return 0


def _reference_strategy(cli: str | None, cfg, device):
    """The Strategy of the run's strategy file (--strategy / --ds-config, else distributed.ds_config,
    else the file a run without one takes on this machine), made from the file alone: prepare is
    one plain process, so nothing of it needs an Accelerator, an engine or a process group. Its
    frozen_like_policy and compute_form say how the run's policy computes (train/strategy/)."""
    from zerotrain.train.launch.ds_config_choice import resolve_ds_config_path
    from zerotrain.train.plan.memory_check import is_auto
    from zerotrain.train.strategy import for_setup
    from zerotrain.train.strategy.ds_config import load_ds_setup
    given = cli or cfg.distributed.ds_config
    if given and is_auto(given):
        raise ConfigError(f"prepare --reference: the strategy file {given} (--strategy / distributed.ds_config) is "
                          f"chosen when the run starts, but the reference is computed as one file computes: pass "
                          f"--strategy with the file the run uses (its start-up banner names it)")
    path = resolve_ds_config_path(given, "python")
    # The batch keys are the run's (its world size is unknown here); precision, backend and the rest are checked.
    return for_setup(load_ds_setup(path, cfg, None, cfg.train.max_steps, cuda=device.type == "cuda", sizes_later=True))
