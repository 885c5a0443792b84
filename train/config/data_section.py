"""The run file's data: section (DataConfig) and its mixture entries (SourceConfig)."""

from __future__ import annotations

import math
import re
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Optional

from zerotrain.train.errors import ConfigError, did_you_mean


@dataclass
class SourceConfig:
    """One token source of a weighted mixture (data.sources)."""
    path: str
    """A .bin token file or a shard directory (both from `zerotrain prepare`), read as data.path
    would be: a sibling .val.bin / the manifest's val shards are its validation split, else the
    last data.val_fraction of it is held out."""
    weight: float
    """Relative share of training samples (> 0; normalised over the sources, need not sum to 1)."""
    name: Optional[str] = None
    """Metrics key (data/tokens/<name>); None = the file or directory name without .bin. Unique
    per mixture."""

    def __post_init__(self):
        if not self.path:
            raise ConfigError("a data.sources entry has an empty path; give its token file or shard directory")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ConfigError(f"data.sources weight of {self.path} must be a number > 0 (got {self.weight}); "
                              f"drop the source instead of giving it weight 0")
        if self.name is None:
            self.name = Path(self.path).name.removesuffix(".bin")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ConfigError(f'data.sources name "{self.name}" ({self.path}) may only use letters, digits, '
                              f"_ . - (it is a metrics key); set name: to one")


# data: keys that only some kinds read (the others apply to several kinds; sources, text_field and
# shuffle_windows have checks with messages of their own in DataConfig.__post_init__).
_DATA_KEYS_FOR_KINDS = {
    "max_bytes": ("text",),
    "token_dtype": ("tokens",),
    "tokenizer": ("sft", "stream"),
    "chat_template": ("sft",),
    "image_size": ("imagefolder",),
    "on_bad_sample": ("imagefolder",),
    "num_samples": ("regression",),
    "num_features": ("regression",),
    "noise": ("regression",),
}


@dataclass
class DataConfig:
    kind: str = "text"
    """text (byte-level, default corpus: this Python's standard library sources), tokens
    (flat uint16/uint32 token file), sft (instruction JSONL: {"prompt", "response"} or chat
    {"messages": [{"role", "content"}, ...]} records, loss on the responses only),
    imagefolder (root/train/<class>/*, root/val/<class>/*), regression (synthetic linear data),
    stream (local parquet/arrow/jsonl files tokenized while training, no prepare step)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """tokens: a weighted mixture of token files / shard directories instead of data.path, e.g.
    [{path: web.bin, weight: 0.7}, {path: code.bin, weight: 0.3, name: code}] (on the command
    line as flow-style YAML or JSON). Each epoch has as many samples as the sources hold together; each source gets
    its weight's share of them, drawn from its own seeded permutation (up-sampled: repeated, each
    sequence once per cycle; down-sampled: a fresh part every epoch). The order is the same for
    any world size or accumulation and resumes exactly; metrics log data/tokens/<name>. All
    sources share data.seq_len, data.token_dtype, data.val_fraction and one tokenizer.
    Validation: the sources' validation splits interleaved in proportion to the weights, so
    val/loss (and its train.eval_batches prefix) measures the same mixture."""
    path: Optional[str] = None
    """text: file or directory of text (None = the embedded default corpus); tokens: the
    .bin file (a sibling .val.bin is the validation split if present), or a shard directory
    from `zerotrain prepare --out DIR` (or its manifest.json; val shards if listed); sft: the .jsonl file
    (a sibling .val.jsonl is the validation split if present), or a .bin set made from it by
    `zerotrain prepare --sft` (tokenized once, memory-mapped; sibling .val.bin); imagefolder: root;
    stream: a .parquet/.arrow/.jsonl file or a directory of them (found as `zerotrain prepare` finds them)."""
    seq_len: Optional[int] = None
    """LM sequence length; None = the model's context length. sft: each record is truncated
    to it (seq_len + 1 tokens) and right-padded."""
    val_fraction: float = 0.05
    """text/tokens/regression/sft without a separate validation file: fraction held out
    (sft: the last records of the file)."""
    tokenizer: Optional[str] = None
    """sft, stream: local Hugging Face tokenizer directory; None = the hf:<dir> model's own directory,
    or bytes (vocab 256; sft: NUL ends a response, stream: newline ends a document) for zerotrain's GPT presets."""
    text_field: Optional[str] = None
    """stream: the record field holding the text (None = "text"); as `zerotrain prepare --text-field`."""
    shuffle_windows: Optional[int] = None
    """stream: windows are shuffled (seeded) inside consecutive groups of this many (None = 1024;
    1 = stream order). A resume re-tokenizes at most one group (train/data/stream/dataset.py)."""
    packing: bool = False
    """sft: pack several records into each row of data.seq_len tokens (best-fit-decreasing in
    windows of 1024 records of a seeded order; train/data/packing.py) instead of one padded record
    per row. Attention stays inside each record and positions restart at 0 per record, so every
    record's loss and gradient are those of the unpacked run; a step's batch is then in rows."""
    document_mask: bool = False
    """tokens (a token file, a shard directory or data.sources), stream: a window that spans several
    documents (each ended by the tokenizer's EOS) attends only inside each one, with positions
    restarting after each EOS (Llama 3's intra-document masking; train/data/document_mask.py).
    Needs the EOS id: recorded by `zerotrain prepare --tokenizer`, or data.eos_id."""
    eos_id: Optional[int] = None
    """data.document_mask: the token id that ends each document (None = the one `zerotrain prepare`
    recorded in the sidecar / manifest, or the stream tokenizer's EOS)."""
    chat_template: bool = True
    """sft: render records with the tokenizer's chat template when it has one; false (or no
    template): the plain format (prompt + response + EOS; chat turns as "role: content")."""
    max_bytes: int = 4_000_000
    """text: cap on corpus size read (the default corpus is larger than needed)."""
    token_dtype: Optional[str] = None
    """tokens: uint16 or uint32; None = read from the .json sidecar written by `zerotrain prepare`."""
    image_size: int = 224
    """imagefolder: train crop / eval centre-crop size (eval resizes to image_size*256/224 first)."""
    on_bad_sample: str = "fail"
    """imagefolder: an unreadable image "fail"s the run (naming the file) or is "skip"ped (logged)."""
    num_samples: int = 4096
    """regression: dataset size."""
    num_features: int = 10
    noise: float = 0.01
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = auto: imagefolder decodes and augments images
    in min(8, CPU cores per local rank - 1) workers, off the training loop; a shard directory (or
    a data.sources mixture with one) is read by 1 worker per rank, which takes the cold reads
    from disk off the step (it prefetches a whole optimizer step); one keeps up with the default
    GPT (BENCHMARKS.md "Data at pre-training scale"), more would only add processes. Text,
    regression and single token files are in memory or one small mapped file and need none (0).
    stream: tokenizer processes per rank (0 = in the training process), None = one per spare
    core per rank, 1 to 4."""

    def __post_init__(self):
        kinds = ("text", "tokens", "sft", "imagefolder", "regression", "stream")
        if self.kind not in kinds:
            raise ConfigError(f'data.kind "{self.kind}" is not one of {", ".join(kinds)}{did_you_mean(self.kind, kinds)}')
        if self.seq_len is not None and self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2 (got {self.seq_len})")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1) (got {self.val_fraction})")
        if self.token_dtype not in (None, "uint16", "uint32"):
            raise ConfigError(f'data.token_dtype must be "uint16" or "uint32" (got "{self.token_dtype}")')
        if self.on_bad_sample not in ("fail", "skip"):
            raise ConfigError(f'data.on_bad_sample must be "fail" or "skip" (got "{self.on_bad_sample}")')
        for k in ("max_bytes", "image_size", "num_samples", "num_features"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"data.{k} must be positive (got {getattr(self, k)})")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0 (got {self.num_workers})")
        self._check_keys_belong_to_kind()
        if self.packing and self.kind != "sft":
            raise ConfigError(f'data.packing packs instruction records (data.kind sft; this run: "{self.kind}")'
                              + ("; token windows are already full, remove it"
                                 if self.kind in ("tokens", "stream", "text") else "; remove it"))
        self._check_document_mask()
        self._check_stream()
        if self.sources:
            self._check_sources()

    def _check_stream(self):
        """The stream-only keys: refused for other kinds, defaulted (text, 1024) and checked for stream."""
        if self.kind != "stream":
            for k in ("text_field", "shuffle_windows"):
                if getattr(self, k) is not None:
                    raise ConfigError(f'data.{k} is for data.kind stream (got "{self.kind}"); remove it'
                                      + (" (`zerotrain prepare --text-field` picks the field of files to prepare)"
                                         if k == "text_field" else ""))
            return
        self.text_field = "text" if self.text_field is None else self.text_field
        self.shuffle_windows = 1024 if self.shuffle_windows is None else self.shuffle_windows
        if not self.text_field:
            raise ConfigError("data.text_field is empty; give the record field holding the text")
        if self.shuffle_windows < 1:
            raise ConfigError(f"data.shuffle_windows must be >= 1 (got {self.shuffle_windows}; 1 = stream order)")
        if self.sources:
            raise ConfigError("data.sources cannot mix streamed files (data.kind stream): `zerotrain prepare "
                              "<files> --text-field F --out DIR` each one first and list the DIRs in "
                              "data.sources with data.kind tokens")

    def _check_sources(self):
        if self.kind != "tokens":
            raise ConfigError(f'data.sources mixes token files: set data.kind to tokens (got "{self.kind}")')
        if self.path is not None:
            raise ConfigError("data.sources and data.path are both set; a mixture lists every file in "
                              "data.sources, so drop data.path")
        seen = {}
        for src in self.sources:
            if src.name in seen:
                raise ConfigError(f'data.sources {seen[src.name]} and {src.path} are both named "{src.name}"; '
                                  f"give one of them a distinct name: key")
            seen[src.name] = src.path

    def _check_document_mask(self):
        if self.document_mask and self.kind not in ("tokens", "stream"):
            fix = {"sft": "for instruction records set data.packing true instead",
                   "text": "`zerotrain prepare` the text with --tokenizer DIR and use data.kind tokens"}
            raise ConfigError(f'data.document_mask masks token windows (data.kind tokens or stream; this run: '
                              f'"{self.kind}"); {fix.get(self.kind, "remove it")}')
        if self.eos_id is not None and not self.document_mask:
            raise ConfigError("data.eos_id is read only with data.document_mask true; set that or remove data.eos_id")
        if self.eos_id is not None and self.eos_id < 0:
            raise ConfigError(f"data.eos_id must be a token id >= 0 (got {self.eos_id})")

    def _check_keys_belong_to_kind(self):
        """A key only another kind reads, set away from its default, would be silently ignored: refuse it."""
        defaults = {f.name: (f.default_factory() if f.default_factory is not MISSING else f.default)
                    for f in fields(self)}
        for key, kinds in _DATA_KEYS_FOR_KINDS.items():
            if self.kind not in kinds and getattr(self, key) != defaults[key]:
                raise ConfigError(f"data.{key} is only read for data.kind {' / '.join(kinds)} "
                                  f'(this run: "{self.kind}"); remove it or set data.kind')

