"""The run file's data: section and its mixture entries (SourceConfig).

The section is a union tagged by `data.kind`: one dataclass per kind (TextData, TokensData,
SftData, PreferenceData, ImageFolderData, RegressionData, StreamData, PyData), each holding only the keys that kind
reads, so a key of another kind is an unknown key naming the kind (train/config/loader.py).
DataConfig(kind=..., **keys) makes the variant of a kind in code."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Optional

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


class DataSection:
    """What every kind's variant shares: the tag (`kind`) and the checks of keys several kinds
    have. A key a kind lacks reads as off for code that asks every kind (the ClassVars): no
    tokenizer, no packing, no document mask, no sequence length of its own."""

    KIND: ClassVar[str]
    TAG: ClassVar[str] = "kind"  # the key that picks the variant (train/config/loader.py)
    seq_len: ClassVar[Optional[int]] = None
    tokenizer: ClassVar[Optional[str]] = None
    packing: ClassVar[bool] = False
    document_mask: ClassVar[bool] = False

    @classmethod
    def variants(cls) -> dict[str, type]:
        return DATA_KINDS

    @classmethod
    def pick(cls, raw: dict) -> type:
        """The variant of a run file's data: mapping (its kind, default text)."""
        kind = raw.get("kind", "text") if isinstance(raw, dict) else "text"
        if kind not in DATA_KINDS:
            raise ConfigError(f'data.kind "{kind}" is not one of {", ".join(DATA_KINDS)}'
                              f'{did_you_mean(str(kind), DATA_KINDS)}')
        return DATA_KINDS[kind]

    @classmethod
    def tag_text(cls) -> str:
        return f"data.kind {cls.KIND}"

    def _check(self):
        """The value checks of the keys this variant has."""
        if self.kind != self.KIND:
            raise ConfigError(f'data.kind "{self.kind}" does not match this section ({self.KIND})')
        if getattr(self, "seq_len", None) is not None and self.seq_len < 2:
            raise ConfigError(f"data.seq_len must be >= 2 (got {self.seq_len})")
        if hasattr(self, "val_fraction") and not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in [0, 1) (got {self.val_fraction})")
        for k in ("max_bytes", "image_size", "num_samples", "num_features"):
            if hasattr(self, k) and getattr(self, k) <= 0:
                raise ConfigError(f"data.{k} must be positive (got {getattr(self, k)})")
        if self.num_workers is not None and self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0 (got {self.num_workers})")


PAD_TO = ("longest", "seq_len")


def _check_document_mask(cfg):
    if cfg.eos_id is not None and not cfg.document_mask:
        raise ConfigError("data.eos_id is read only with data.document_mask true; set that or remove data.eos_id")
    if cfg.eos_id is not None and cfg.eos_id < 0:
        raise ConfigError(f"data.eos_id must be a token id >= 0 (got {cfg.eos_id})")


def _check_pad_to(pad_to: str):
    if pad_to not in PAD_TO:
        raise ConfigError(f'data.pad_to must be one of {", ".join(PAD_TO)} (got "{pad_to}")')


@dataclass
class TextData(DataSection):
    """byte-level language modelling on text (default corpus: this Python's standard library sources)."""
    KIND: ClassVar[str] = "text"
    kind: str = "text"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    path: Optional[str] = None
    """A file or directory of text, or a .parquet/.arrow file, a glob of them or a `save_to_disk`
    directory whose "text" column is the text (rows joined by newlines); None = the embedded
    default corpus."""
    seq_len: Optional[int] = None
    """LM sequence length; None = the model's context length."""
    subset: Optional[str] = None
    """With a Hub dataset id as data.path: the subset (`datasets`' configuration name, e.g.
    "default"); None = the dataset's only or default one. Refused for local paths."""
    split: Optional[str] = None
    """With a Hub dataset id or a save_to_disk DatasetDict as data.path: the split trained on
    (None = "train"); validation is then the "validation" (else "test") split when training on
    "train", else data.val_fraction. Refused for other paths."""
    val_fraction: float = 0.05
    """Fraction of the bytes held out for validation (the end of the corpus)."""
    max_bytes: int = 4_000_000
    """Cap on corpus size read (the default corpus is larger than needed)."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = 0: the bytes are in memory."""

    def __post_init__(self):
        self._check()


@dataclass
class TokensData(DataSection):
    """flat uint16/uint32 token files or shard directories from `zerotrain prepare`, or a weighted mixture of them."""
    KIND: ClassVar[str] = "tokens"
    kind: str = "tokens"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    path: Optional[str] = None
    """The .bin file (a sibling .val.bin is the validation split if present), or a shard
    directory from `zerotrain prepare --out DIR` (or its manifest.json; val shards if listed)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A weighted mixture of token files / shard directories instead of data.path, e.g.
    [{path: web.bin, weight: 0.7}, {path: code.bin, weight: 0.3, name: code}] (on the command
    line as flow-style YAML or JSON). Each epoch has as many samples as the sources hold together; each source gets
    its weight's share of them, drawn from its own seeded permutation (up-sampled: repeated, each
    sequence once per cycle; down-sampled: a fresh part every epoch). The order is the same for
    any world size or accumulation and resumes exactly; metrics log data/tokens/<name>. All
    sources share data.seq_len, data.token_dtype, data.val_fraction and one tokenizer.
    Validation: the sources' validation splits interleaved in proportion to the weights, so
    val/loss (and its train.eval_batches prefix) measures the same mixture."""
    seq_len: Optional[int] = None
    """LM sequence length; None = the model's context length."""
    val_fraction: float = 0.05
    """Without a separate validation file / val shards: the fraction of the tokens held out."""
    token_dtype: Optional[str] = None
    """uint16 or uint32; None = read from the .json sidecar written by `zerotrain prepare`."""
    document_mask: bool = False
    """A window that spans several documents (each ended by the tokenizer's EOS) attends only
    inside each one, with positions restarting after each EOS (Llama 3's intra-document masking;
    train/data/document_mask.py). Needs the EOS id: recorded by `zerotrain prepare --tokenizer`,
    or data.eos_id."""
    eos_id: Optional[int] = None
    """With data.document_mask: the token id that ends each document (None = the one `zerotrain
    prepare` recorded in the sidecar / manifest)."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = auto: a shard directory (or a data.sources
    mixture with one) is read by 1 worker per rank, which takes the cold reads from disk off the
    step (it prefetches a whole optimizer step); one keeps up with the default GPT (BENCHMARKS.md
    "Data at pre-training scale"), more would only add processes. A single token file is one
    small mapped file and needs none (0)."""

    def __post_init__(self):
        self._check()
        if self.token_dtype not in (None, "uint16", "uint32"):
            raise ConfigError(f'data.token_dtype must be "uint16" or "uint32" (got "{self.token_dtype}")')
        _check_document_mask(self)
        if self.sources:
            self._check_sources()

    def _check_sources(self):
        if self.path is not None:
            raise ConfigError("data.sources and data.path are both set; a mixture lists every file in "
                              "data.sources, so drop data.path")
        seen = {}
        for src in self.sources:
            if src.name in seen:
                raise ConfigError(f'data.sources {seen[src.name]} and {src.path} are both named "{src.name}"; '
                                  f"give one of them a distinct name: key")
            seen[src.name] = src.path


@dataclass
class SftData(DataSection):
    """instruction records (JSONL, parquet, arrow, save_to_disk) in TRL's formats (messages,
    prompt-completion, text) or {"prompt", "response"}; loss on the responses only (text: all)."""
    KIND: ClassVar[str] = "sft"
    kind: str = "sft"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    path: Optional[str] = None
    """The records: a .jsonl file (a sibling .val.jsonl is the validation split if present), a
    .parquet or .arrow file (sibling .val.parquet / .val.arrow), a glob of such files, or a
    `save_to_disk` directory (a DatasetDict: its "train" split, "validation" or else "test" for
    validation), read through `datasets`, memory-mapped; or a .bin set made from a .jsonl by
    `zerotrain prepare --sft` (tokenized once, memory-mapped; sibling .val.bin). The format is
    found from the columns, by TRL's names: {"messages"}, {"prompt", "completion"} (strings or
    message lists), {"text"} (every token trained), or zerotrain's {"prompt", "response"}."""
    seq_len: Optional[int] = None
    """Each record is truncated to it (seq_len + 1 tokens) and right-padded; None = the model's
    context length."""
    subset: Optional[str] = None
    """With a Hub dataset id as data.path: the subset (`datasets`' configuration name, e.g.
    "default"); None = the dataset's only or default one. Refused for local paths."""
    split: Optional[str] = None
    """With a Hub dataset id or a save_to_disk DatasetDict as data.path: the split trained on
    (None = "train"); validation is then the "validation" (else "test") split when training on
    "train", else data.val_fraction. Refused for other paths."""
    val_fraction: float = 0.05
    """Without a separate validation file: the fraction of records held out (the last ones)."""
    tokenizer: Optional[str] = None
    """Local Hugging Face tokenizer directory, or a Hub id org/name[@revision] (through the
    cache, as model.name hf:); None = the hf: model's own directory, or bytes
    (vocab 256, NUL ends a response) for zerotrain's GPT presets."""
    chat_template: bool = True
    """Render records with the tokenizer's chat template when it has one; false (or no
    template): the plain format (prompt + response + EOS; chat turns as "role: content")."""
    packing: bool = False
    """Pack several records into each row of data.seq_len tokens (best-fit-decreasing in
    windows of 1024 records of a seeded order; train/data/packing.py) instead of one padded record
    per row. Attention stays inside each record and positions restart at 0 per record, so every
    record's loss and gradient are those of the unpacked run; a step's batch is then in rows."""
    pad_to: str = "longest"
    """Without packing, how far each micro-batch's records are right-padded: "longest" = to the
    batch's longest record rounded up to a multiple of 64 (at most seq_len), so short records
    do not compute seq_len positions; "seq_len" = every sample to data.seq_len. The same records
    per step and the same loss either way (trailing pads are never attended to by a real token).
    Padded to seq_len regardless, as the banner notes, where a run needs one length: sequence
    parallelism (each row is split into equal slices), hardware.compile (one graph, no
    recompilation per length), a sparse-MoE model (its router's aux loss counts pad positions
    too) and a py: model that computes its own loss (its loss over the pads is its own)."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = 0: the records are in memory or one mapped file."""

    def __post_init__(self):
        self._check()
        _check_pad_to(self.pad_to)


@dataclass
class PreferenceData(DataSection):
    """preference pairs (JSONL, parquet, arrow, save_to_disk) in TRL's formats (explicit or implicit
    prompt; strings, or chat messages through the tokenizer's template), for train.objective dpo;
    the loss on the response tokens only."""
    KIND: ClassVar[str] = "preference"
    kind: str = "preference"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    path: Optional[str] = None
    """The records: a .jsonl file (a sibling .val.jsonl is the validation split if present), a
    .parquet or .arrow file, a glob of them or a `save_to_disk` directory (as data.kind sft's).
    {"prompt", "chosen", "rejected"} (explicit prompt) or {"chosen", "rejected"} (implicit
    prompt: the shared prefix is the prompt, found as TRL's extract_prompt finds it). prompt: a
    string or a list of {"role", "content"} messages; chosen / rejected: a string or a list of
    assistant messages."""
    seq_len: Optional[int] = None
    """Each of a record's two sequences (prompt + chosen, prompt + rejected) is at most seq_len + 1
    tokens: the prompt is kept whole, each response is cut at its end (docs/workloads.md); a
    prompt that leaves no response token is refused. None = the model's context length."""
    subset: Optional[str] = None
    """With a Hub dataset id as data.path: the subset (`datasets`' configuration name, e.g.
    "default"); None = the dataset's only or default one. Refused for local paths."""
    split: Optional[str] = None
    """With a Hub dataset id or a save_to_disk DatasetDict as data.path: the split trained on
    (None = "train"); validation is then the "validation" (else "test") split when training on
    "train", else data.val_fraction. Refused for other paths."""
    val_fraction: float = 0.05
    """Without a separate validation file: the fraction of records held out (the last ones)."""
    tokenizer: Optional[str] = None
    """Local Hugging Face tokenizer directory, or a Hub id org/name[@revision] (through the
    cache, as model.name hf:); None = the hf: model's own directory, or bytes
    (vocab 256, NUL ends a response) for zerotrain's GPT presets."""
    chat_template: bool = True
    """Render records with the tokenizer's chat template when it has one (as data.kind sft)."""
    packing: bool = False
    """Pack the chosen and rejected sequences of a micro-batch's pairs into rows of seq_len tokens
    (best-fit-decreasing), each sequence attending only inside itself with positions restarting
    (the document mask; no FlashAttention needed): fewer, fuller rows than two padded rows per
    pair. The same pairs per micro-batch, the same loss and gradients (docs/workloads.md)."""
    pad_to: str = "seq_len"
    """Without packing, how far a micro-batch's chosen and rejected rows are right-padded:
    "seq_len" = every row to data.seq_len; "longest" = to the longest sequence of the micro-batch
    (either side) rounded up to a multiple of 64, at most seq_len, as data.kind sft's. The same
    pairs per step and the same loss to fp32 rounding (trailing pads are never attended to by a
    real token). Padded to seq_len regardless, as the banner notes, where a run needs one length
    (data.kind sft's pad_to lists when). The default stays seq_len: a precomputed reference
    (train.dpo.reference) is computed on seq_len rows, and the live one then sees the same shapes.
    data.packing builds its own rows: "longest" is refused with it."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = 0: the records are in memory."""

    def __post_init__(self):
        self._check()
        _check_pad_to(self.pad_to)
        if self.packing and self.pad_to == "longest":
            raise ConfigError("data.pad_to longest does not apply with data.packing true (packed pairs fill rows of "
                              "data.seq_len); set one of them: data.packing false or data.pad_to seq_len")


@dataclass
class ImageFolderData(DataSection):
    """images in root/train/<class>/*, root/val/<class>/*."""
    KIND: ClassVar[str] = "imagefolder"
    kind: str = "imagefolder"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    path: Optional[str] = None
    """The root holding train/ and val/."""
    image_size: int = 224
    """Train crop / eval centre-crop size (eval resizes to image_size*256/224 first)."""
    on_bad_sample: str = "fail"
    """An unreadable image "fail"s the run (naming the file) or is "skip"ped (logged)."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = auto: images are decoded and augmented in
    min(8, CPU cores per local rank - 1) workers, off the training loop."""

    def __post_init__(self):
        self._check()
        if self.on_bad_sample not in ("fail", "skip"):
            raise ConfigError(f'data.on_bad_sample must be "fail" or "skip" (got "{self.on_bad_sample}")')


@dataclass
class RegressionData(DataSection):
    """synthetic linear data (for model "linear")."""
    KIND: ClassVar[str] = "regression"
    kind: str = "regression"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    num_samples: int = 4096
    """Dataset size."""
    num_features: int = 10
    noise: float = 0.01
    val_fraction: float = 0.05
    """Fraction held out for validation."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = 0: the data is made in memory."""

    def __post_init__(self):
        self._check()


@dataclass
class StreamData(DataSection):
    """local parquet/arrow/jsonl files tokenized while training, no prepare step."""
    KIND: ClassVar[str] = "stream"
    kind: str = "stream"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    path: Optional[str] = None
    """A .parquet/.arrow/.jsonl file or a directory of them (found as `zerotrain prepare` finds them)."""
    seq_len: Optional[int] = None
    """LM sequence length; None = the model's context length."""
    val_fraction: float = 0.05
    """Fraction of the stream's tokens held out for validation."""
    tokenizer: Optional[str] = None
    """Local Hugging Face tokenizer directory, or a Hub id org/name[@revision] (through the
    cache, as model.name hf:); None = the hf: model's own directory, or bytes
    (vocab 256, newline ends a document) for zerotrain's GPT presets."""
    text_field: str = "text"
    """The record field holding the text; as `zerotrain prepare --text-field`."""
    shuffle_windows: int = 1024
    """Windows are shuffled (seeded) inside consecutive groups of this many (1 = stream order).
    A resume re-tokenizes at most one group (train/data/stream/dataset.py)."""
    document_mask: bool = False
    """A window that spans several documents attends only inside each one, with positions
    restarting after each EOS (Llama 3's intra-document masking; train/data/document_mask.py)."""
    eos_id: Optional[int] = None
    """With data.document_mask: the token id that ends each document (None = the tokenizer's EOS)."""
    num_workers: Optional[int] = None
    """Tokenizer processes per rank (0 = in the training process); None = one per spare core
    per rank, 1 to 4."""

    def __post_init__(self):
        self._check()
        if not self.text_field:
            raise ConfigError("data.text_field is empty; give the record field holding the text")
        if self.shuffle_windows < 1:
            raise ConfigError(f"data.shuffle_windows must be >= 1 (got {self.shuffle_windows}; 1 = stream order)")
        _check_document_mask(self)


@dataclass
class PyData(DataSection):
    """your own map-style torch Dataset from a factory, "module:function" (train/data/user.py)."""
    KIND: ClassVar[str] = "py"
    kind: str = "py"
    """text, tokens, sft, preference, imagefolder, regression, stream or py: it decides the section's
    other keys (--help lists each kind's)."""
    factory: Optional[str] = None
    """"module:function", imported by its dotted name (PYTHONPATH, an installed package or the
    directory you launch from) and called with data.kwargs. It returns a map-style Dataset
    (__len__ and __getitem__, samples that are dicts of tensors), or a mapping {"train": Dataset,
    "val": Dataset or None, "collate_fn": a function from a list of samples to a dict batch, or
    None}. The samples go through the same global-batch sampler as every kind: the same order for
    any world size and accumulation, and exact resume."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments passed to the factory (a mapping; on the command line YAML or JSON, e.g.
    --data.kwargs '{n: 1000}')."""
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank. None = 0: samples are made in the training process."""

    def __post_init__(self):
        self._check()
        if not self.factory:
            raise ConfigError('data.kind py needs data.factory: "module:function" returning a map-style Dataset')
        module, _, function = self.factory.rpartition(":")
        if not module or not function or not all(p.isidentifier() for p in module.split(".")) \
                or not function.isidentifier():
            raise ConfigError(f'data.factory "{self.factory}" is not "module:function"; write the dotted module name, '
                              f'a colon and the function that returns the Dataset, e.g. "my_pkg.data:build"')


DATA_KINDS: dict[str, type] = {c.KIND: c for c in (TextData, TokensData, SftData, PreferenceData, ImageFolderData, RegressionData,
                                                   StreamData, PyData)}


def DataConfig(kind: str = "text", **keys) -> DataSection:  # noqa: N802 - reads like the section it makes
    """The data: section of `kind` with `keys`, e.g. DataConfig(kind="tokens", path="x.bin").
    A key the kind does not read raises a ConfigError naming the kind."""
    cls = DataSection.pick({"kind": kind})
    names = [f.name for f in fields(cls)]
    for k in keys:
        if k not in names:
            raise ConfigError(f"data.{k} is not a key of data.kind {kind}; its keys: {', '.join(names)}"
                              f"{did_you_mean(k, names)}")
    return cls(kind=kind, **keys)
