"""The windows of data.kind stream: a Dataset over the endless token stream, the sampler's
shuffle, the cursor a resume restarts from, and the data bundle.

The token stream is the concatenation of every chunk's tokens in stream order (readers.py);
window w is tokens [w T, w T + T + 1) (T = seq_len: inputs and shifted labels, stride T).
Windows cross document, chunk, file and pass boundaries; nothing is padded or dropped, so the
tokens are exactly the documents tokenized and concatenated with separators (tests/test_stream.py).

Order: sample position p maps to window g C + perm_g[p mod C] (g = p div C, C =
data.shuffle_windows, perm_g seeded by (seed, g)): a seeded shuffle inside consecutive groups of
C windows, so a batch mixes windows of different documents. The GlobalBatchSampler
(train/data/sampler.py) hands out positions as for any dataset, so the global batches are the
same for any world size and accumulation. Every rank reads and tokenizes the whole stream (each
packs only the windows it trains on): the price of that independence without random access;
`zerotrain prepare` tokenizes once instead (BENCHMARKS.md "Streaming tokenization").

Resume: a stream has no random access, so a checkpoint's data position carries a cursor
(TrainState.data_cursor): the chunk holding the first token of the current shuffle group and
the token offset in it. A resumed run restarts reading there and re-tokenizes at most one group
plus one chunk. A pass's length is unknown before it is tokenized, so a stream is one endless
epoch (train.epochs is refused; the run lasts train.max_steps).

Validation: the first VAL_WINDOWS windows of the held-out documents, in file order, read and
tokenized at start-up (a large corpus only until they are found).
"""

from __future__ import annotations

import collections
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.train.data.prep_sources import make_tokenizer
from zerotrain.train.data.sampler import GlobalBatchSampler
from zerotrain.train.data.stream.pool import default_workers, start_pool, submit_chunk
from zerotrain.train.data.stream.readers import StreamCorpus, tokenize_chunk
from zerotrain.train.errors import DataError

VAL_WINDOWS = 1024        # the validation set's size cap, in windows
STREAM_SAMPLES = 1 << 62  # "endless": the sampler's epoch (no stream ends inside a run)


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
            self._pending.append((K, submit_chunk(self._pool, f, first, payload, self.val_fraction)))
        else:
            self._pending.append((K, (f, first, payload)))

    def _start_pool(self):
        self._pool, self._finalize_pool = start_pool(self, self.workers, self.spec)

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



def build_stream(cfg, seq_len: Optional[int], seed: int, tokenizer: Optional[str]):
    from zerotrain.train.data.bundle import DataBundle
    from zerotrain.train.data.text import TokenSequences
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
        import zerotrain.train.data.document_mask as document_mask
        eos = document_mask.resolve_eos(cfg, f"data.path {corpus.root} (tokenized by {tokenizer or 'bytes'})",
                                        tok.name, list(tok.separator), None)
    train = StreamWindows(corpus, seq_len, tokenizer, workers, group, cfg.val_fraction, tokenizer=tok)
    held = val_tokens(corpus, tok, cfg.val_fraction, VAL_WINDOWS * seq_len + 1)
    val = TokenSequences(held, seq_len) if len(held) > seq_len + 1 else None
    decode = None
    if tok.name == "bytes":
        from zerotrain.train.data.text import decode
    names = ", ".join(f.name for f in corpus.files[:3]) + (", ..." if len(corpus.files) > 3 else "")
    bundle = DataBundle(train=train, val=val, task="lm", items_per_sample=seq_len, vocab_size=tok.vocab_size,
                        seq_len=seq_len, decode=decode, stream=train,
                        describe=f"streamed {len(corpus.files)} file(s) under {corpus.root} ({names}; field "
                                 f"{field!r}, {corpus.per_pass} chunks per pass), tokenized by "
                                 f"{'bytes' if tok.name == 'bytes' else tokenizer} in {workers} worker(s) per rank, "
                                 f"windows of {seq_len} shuffled in groups of {group}; "
                                 + (f"val: {len(val)} windows of held-out documents" if val else "no validation"),
                        extra={"tokenizer": tok.name, "stream_workers": workers})
    return bundle if eos is None else document_mask.apply(bundle, eos)
