"""Token files for LM pre-training: a flat uint16/uint32 array read by memory map.

Layout (written by `zerotrain prepare`, see train/commands/prepare.py):
    corpus.bin        the training tokens, native little-endian, no header
    corpus.json       sidecar: {"dtype", "vocab_size", "num_tokens", "max_token", "tokenizer", ...}
    corpus.val.bin    optional validation tokens (+ corpus.val.json); without it the last
                      data.val_fraction of corpus.bin is held out

or a directory of shards with a manifest (train/data/shards.py), same samples per shard.

A file from elsewhere works too: pass data.token_dtype (and the model's vocabulary bounds
the ids). Sequences are non-overlapping windows of seq_len+1 tokens (input, shifted
labels); only the windows a batch needs are read. The sampler (train/data/sampler.py)
visits each whole sequence once per epoch; the last (num_sequences mod global batch)
sequences of an epoch's permutation are dropped so every step is full.

Cheap checks before training, so a bad file fails in seconds rather than at step 10k:
size is a multiple of the token width, the sidecar matches the file, and the largest
token id (recorded by prepare; scanned in chunks if there is no sidecar) fits the model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np

import zerotrain.train.data.document_mask as document_mask
from zerotrain.train.config import TokensData
from zerotrain.train.data.bundle import DataBundle
from zerotrain.train.data.shards import build_shards, is_sharded
from zerotrain.train.errors import DataError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
FORMAT = "zerotrain-tokens"


def sidecar_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".json")


def val_path(bin_path: Path) -> Path:
    return bin_path.with_suffix(".val.bin")


def max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """Largest id, scanning a memmap in 16M-token chunks (bounded memory)."""
    top = 0
    for start in range(0, len(tokens), chunk):
        top = max(top, int(tokens[start:start + chunk].max()))
    return top


def read_sidecar(bin_path: Path) -> Optional[dict]:
    side = sidecar_path(bin_path)
    if not side.is_file():
        return None
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{side}: not valid JSON ({e}); re-run `zerotrain prepare` or delete it and pass "
                        f"data.token_dtype") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("dtype") not in DTYPES:
        raise DataError(f"{side} is not a zerotrain token sidecar (needs format={FORMAT!r} and dtype uint16/uint32); "
                        f"re-run `zerotrain prepare` or delete it and pass data.token_dtype")
    return meta


class TokenFile:
    """One checked, memory-mapped token file."""

    def __init__(self, path: Path, token_dtype: Optional[str]):
        self.path = path
        if not path.is_file():
            raise DataError(f"data.path {path} does not exist (data.kind = tokens expects a .bin token file; "
                            f"make one with `zerotrain prepare <text files> --out {path}`)")
        meta = read_sidecar(path)
        dtype = token_dtype or (meta or {}).get("dtype")
        if dtype is None:
            raise DataError(f"{path} has no sidecar {sidecar_path(path).name}: pass data.token_dtype uint16 or "
                            f"uint32 (or re-create it with `zerotrain prepare`)")
        if meta and token_dtype and token_dtype != meta["dtype"]:
            raise DataError(f"data.token_dtype {token_dtype} contradicts {sidecar_path(path)} (dtype "
                            f"{meta['dtype']}); drop data.token_dtype")
        width = np.dtype(DTYPES[dtype]).itemsize
        size = path.stat().st_size
        if size % width:
            raise DataError(f"{path}: size {size} bytes is not a multiple of the {dtype} token width ({width} bytes); "
                            f"the file is truncated or not {dtype} (check data.token_dtype)")
        n = size // width
        if meta and meta.get("num_tokens") not in (None, n):
            raise DataError(f"{path} holds {n} tokens but {sidecar_path(path).name} says {meta['num_tokens']}: the "
                            f"file changed after `zerotrain prepare`; re-run it")
        if n < 2:
            raise DataError(f"{path} holds {n} tokens; a language model needs at least a few sequences")
        self.dtype, self.num_tokens, self.meta = dtype, n, meta or {}
        self.tokens = np.memmap(path, dtype=DTYPES[dtype], mode="r", shape=(n,))
        if meta and "max_token" in meta:
            self.max_token = int(meta["max_token"])
        else:
            print(f"zerotrain: scanning {path} for its largest token id (no sidecar)", file=sys.stderr, flush=True)
            self.max_token = max_token(self.tokens)
        self.vocab_size = self.meta.get("vocab_size")


def build_tokens(cfg: TokensData, seq_len: Optional[int]):
    from zerotrain.train.data.text import TokenSequences
    if cfg.path is None:
        raise DataError("data.kind = tokens needs data.path (a .bin token file or a shard directory from "
                        "`zerotrain prepare`)")
    if seq_len is None:
        raise DataError("data.kind = tokens needs data.seq_len (the model has no context length to default to)")
    from zerotrain.train.data.prep_sources import DATASET_SUFFIXES
    if Path(cfg.path).suffix.lower() in DATASET_SUFFIXES and not is_sharded(Path(cfg.path)):  # manifest.json is ours
        raise DataError(f"data.path {cfg.path} is a parquet/arrow/jsonl file, not tokens: set data.kind stream (and "
                        f"data.text_field) to tokenize it while training, or `zerotrain prepare {cfg.path} "
                        f"--text-field FIELD --out DIR` it first")
    if is_sharded(Path(cfg.path).expanduser()):  # a directory of shards (train/data/shards.py)
        bundle = build_shards(Path(cfg.path).expanduser(), cfg.token_dtype, cfg.val_fraction, seq_len)
        corpus = bundle.train.corpus
        return _document_masked(cfg, bundle, str(corpus.dir), corpus.meta, corpus.max_token,
                                lambda: corpus.read(0, 0, int(min(corpus.sizes[0], document_mask.HEAD_TOKENS))))
    train = TokenFile(Path(cfg.path).expanduser(), cfg.token_dtype)
    val_file = val_path(train.path)
    val = TokenFile(val_file, cfg.token_dtype or train.dtype) if val_file.is_file() else None
    if val is not None and val.dtype != train.dtype:
        raise DataError(f"{val_file} is {val.dtype} but {train.path} is {train.dtype}; re-run `zerotrain prepare`")
    train_tokens, val_tokens, split = train.tokens, None, f"val: {val_file.name}"
    if val is not None:
        val_tokens = val.tokens
    elif cfg.val_fraction > 0:
        n_val = int(train.num_tokens * cfg.val_fraction)
        if n_val > seq_len + 1:  # memmap slices stay views: nothing is read here
            train_tokens, val_tokens = train.tokens[:-n_val], train.tokens[-n_val:]
        split = f"val: last {cfg.val_fraction:.0%}" if val_tokens is not None else "no validation"
    else:
        split = "no validation"  # no sibling .val.bin and data.val_fraction 0
    sequences = TokenSequences(train_tokens, seq_len)
    if len(sequences) == 0:
        raise DataError(f"{train.path}: {len(train_tokens)} training tokens make no sequence of data.seq_len "
                        f"{seq_len}+1; use more data or a shorter data.seq_len")
    vocab = train.vocab_size or (max(train.max_token, val.max_token if val else 0) + 1)
    max_id = max(train.max_token, val.max_token if val else 0)
    decode = _decoder(train.meta)
    bundle = DataBundle(train=sequences, val=TokenSequences(val_tokens, seq_len) if val_tokens is not None else None,
                        task="lm", items_per_sample=seq_len, vocab_size=vocab, seq_len=seq_len, decode=decode,
                        describe=f"token file {train.path} ({train.num_tokens / 1e6:.2f}M {train.dtype} tokens, "
                                 f"{len(sequences)} sequences of {seq_len}; {split})",
                        extra={"max_token": max_id, "token_file": str(train.path),
                               "tokenizer": train.meta.get("tokenizer")})
    return _document_masked(cfg, bundle, str(train.path), train.meta, max_id,
                            lambda: np.asarray(train_tokens[:document_mask.HEAD_TOKENS]))


def _document_masked(cfg: TokensData, bundle: DataBundle, where: str, meta: dict, max_id: int, head):
    """data.document_mask: the bundle's windows masked at the EOS its sidecar / manifest records
    (train/data/document_mask.py); otherwise the bundle as it is."""
    if not cfg.document_mask:
        return bundle
    eos = document_mask.resolve_eos(cfg, where, meta.get("tokenizer"), meta.get("separator"), max_id, head)
    return document_mask.apply(bundle, eos)


def _decoder(meta: dict):
    if meta.get("tokenizer") == "bytes":
        from zerotrain.train.data.text import decode
        return decode
    return None
