"""The run configuration: a typed dataclass tree loaded strictly from JSON/YAML.

Order of precedence: dataclass defaults < run file (``--config run.yaml``) < dotted
CLI overrides (``--optim.lr 3e-4``). Unknown keys, wrong types and impossible values
fail with a ConfigError naming the key. DeepSpeed/ZeRO/precision settings are *not*
here: they live in the DeepSpeed JSON (``distributed.ds_config``), see dsconfig.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from models.config import ModelConfig  # the model: section lives with the models (models/ needs nothing from train/)
from train.errors import ConfigError, did_you_mean


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
    1 = stream order). A resume re-tokenizes at most one group (train/data/stream.py)."""
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
    a data.sources mixture with one) is read by 1 worker per rank: a corpus on disk costs a
    cold read of ~0.1-0.2 ms per sample (measured here), which a worker takes off the step (it
    prefetches a whole optimizer step); one keeps up with the default GPT with room to spare
    (bench/data_scale.py, BENCHMARKS.md), more would only add processes. Text, regression and
    single token files are in memory or one small mapped file and need none (0). stream: tokenizer
    processes per rank (0 = in the training process), None = one per spare core per rank, 1 to 4."""

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
        if self.kind != "stream":
            for k in ("text_field", "shuffle_windows"):
                if getattr(self, k) is not None:
                    raise ConfigError(f'data.{k} is for data.kind stream (got "{self.kind}"); remove it'
                                      + (" (`zerotrain prepare --text-field` picks the field of files to prepare)"
                                         if k == "text_field" else ""))
        else:
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
        if self.sources:
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


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate (after warmup)."""
    min_lr: float = 3e-5
    """Floor of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup, in optimizer steps (global, independent of world size and accumulation)."""
    schedule: str = "cosine"
    """cosine | linear | constant (after warmup)."""
    weight_decay: float = 0.1
    """Decoupled (AdamW); not applied to norms, biases or embeddings."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0 (got {self.lr})")
        if self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"optim.min_lr must be in [0, optim.lr={self.lr}] (got {self.min_lr})")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps must be >= 0 (got {self.warmup_steps})")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ConfigError(f'optim.schedule must be cosine, linear or constant (got "{self.schedule}")')
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0 (got {self.weight_decay})")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas must both be in [0, 1) (got {list(self.betas)})")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0 (got {self.eps})")

    def lr_at(self, step: int, max_steps: int) -> float:
        """LR for optimizer step `step` (0-based). A pure function of the global step, so it is
        the same for any number of processes or accumulation steps and needs no state on resume."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if self.schedule == "constant":
            return self.lr
        decay = max(1, max_steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / decay)
        if self.schedule == "linear":
            return self.lr - (self.lr - self.min_lr) * frac
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * frac))


@dataclass
class TrainConfig:
    seed: int = 1234
    micro_batch_size: int = 8
    """Samples per process per forward/backward."""
    grad_accum_steps: Optional[int] = None
    """Micro-batches accumulated per optimizer step. None = derived from global_batch_size, else 1."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all processes = micro_batch_size x grad_accum_steps x world size."""
    max_steps: int = 300
    """Optimizer steps to train (ignored when epochs is set)."""
    epochs: Optional[int] = None
    """Train for this many passes over the training set instead of max_steps."""
    eval_every: int = 100
    """Evaluate every N optimizer steps (0 = only at the end)."""
    eval_batches: Optional[int] = 20
    """Validation micro-batches per process per evaluation (None = the whole validation set)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping). The logged norm is pre-clip."""
    run_dir: str = "runs/default"
    """Where config, metrics.jsonl, checkpoints and exported weights go."""
    sample_tokens: int = 200
    """LM: bytes/tokens generated as a sample at the end (0 = none)."""
    progress: bool = True
    """Show the tqdm progress bar (main process only)."""
    nan_policy: str = "skip"
    """On a NaN/Inf loss: "skip" the step (counted) or "stop" (checkpoint the last good state)."""
    max_bad_steps: int = 5
    """Stop after this many consecutive non-finite steps, whatever nan_policy says. Both are
    decided at each log line (logging.every_steps) and before each checkpoint, where the trainer
    reads the gradient norms it kept on the device: skipped steps never touch the weights, so a
    stop can come up to logging.every_steps steps after its cause and still saves the last good state."""
    trace_data: bool = False
    """Debug: every rank appends a fingerprint (crc32) of each sample it trains on to
    <run_dir>/ranks/rank<R>.data.jsonl, to verify sharding and resume order."""
    compile: bool = False
    """torch.compile the model (TorchInductor) before wrapping it: fused kernels, usually faster
    steps on GPU after a compile of tens of seconds to minutes at the first step. Off by default
    (compile time; on CPU it needs a C++ compiler). DDP, ZeRO-0/1/2; refused with ZeRO-3, whose
    parameter gathering hooks break compiled graphs."""
    tf32: bool = True
    """CUDA: fp32 matmuls and convolutions use TensorFloat-32 tensor cores (inputs rounded to a
    10-bit mantissa, fp32 accumulation; up to 8x the fp32 rate on A100/H100), as PyTorch's
    "high" float32 matmul precision. Affects fp32 runs only (bf16/fp16 use their own units);
    false = full fp32. Without a GPU there is nothing to set."""
    host_malloc: str = "auto"
    """Host memory allocator on a CPU-only machine: "compact" returns every freed block of 1 MiB
    or more to the OS at once (resident memory follows live tensors, at a cost in step time),
    "glibc" keeps glibc's default (freed blocks stay resident for reuse, fastest). "auto" =
    glibc, unless the memory check finds the run would not fit without compact
    (train/launch/host_settings.py; the banner then says so). MALLOC_MMAP_THRESHOLD_ in the
    environment wins."""

    def __post_init__(self):
        for k in ("micro_batch_size", "max_steps"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"train.{k} must be a positive integer (got {getattr(self, k)})")
        for k in ("grad_accum_steps", "global_batch_size", "epochs", "eval_batches"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ConfigError(f"train.{k} must be a positive integer or null (got {v})")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0 (got {self.eval_every})")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (got {self.grad_clip})")
        if self.sample_tokens < 0:
            raise ConfigError(f"train.sample_tokens must be >= 0 (got {self.sample_tokens})")
        if self.nan_policy not in ("skip", "stop"):
            raise ConfigError(f'train.nan_policy must be "skip" or "stop" (got "{self.nan_policy}")')
        if self.max_bad_steps <= 0:
            raise ConfigError(f"train.max_bad_steps must be positive (got {self.max_bad_steps})")
        if self.host_malloc not in ("auto", "compact", "glibc"):
            raise ConfigError(f'train.host_malloc must be "auto", "compact" or "glibc" (got "{self.host_malloc}")')

    def batch(self, world_size: int) -> "Batch":
        """Resolve micro x accumulation x world = global, checking divisibility."""
        micro = self.micro_batch_size
        if self.global_batch_size is not None:
            per_step = micro * world_size
            if self.global_batch_size % per_step:
                raise ConfigError(
                    f"train.global_batch_size={self.global_batch_size} is not divisible by "
                    f"train.micro_batch_size x world size = {micro} x {world_size} = {per_step}; "
                    f"use a multiple of {per_step} or change the micro-batch")
            accum = self.global_batch_size // per_step
            if self.grad_accum_steps is not None and self.grad_accum_steps != accum:
                raise ConfigError(
                    f"train.grad_accum_steps={self.grad_accum_steps} contradicts train.global_batch_size="
                    f"{self.global_batch_size} (= {micro} x {accum} x {world_size} processes); set only one")
        else:
            accum = self.grad_accum_steps or 1
        return Batch(micro=micro, accum=accum, world=world_size)


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    world: int

    @property
    def global_size(self) -> int:
        return self.micro * self.accum * self.world


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save resumable state every N optimizer steps (0 = only at the end / on SIGTERM)."""
    every_minutes: float = 0.0
    """Also save when this much wall time (minutes) has passed since the end of the last save, or
    since the first step (0 = off). Combined with every_steps, whichever comes first: any save
    restarts this clock, a time-based save does not shift the every_steps multiples. The time is
    rank 0's clock, sent with the stop vote every step (no extra collective, no device sync), so
    every rank saves at the same step: the end of the step after the one in which the time ran
    out (at most ~2 step times late). Choosing a value: docs/checkpoints.md "Choosing a cadence"."""
    keep_last: int = 2
    """Keep this many newest complete checkpoints; older ones are pruned after a save completes."""
    save_at_end: bool = True
    """Save resumable state when training ends (SIGTERM/SIGINT always saves)."""
    export: bool = True
    """Export consolidated weights (sharded safetensors, HF layout) to <run_dir>/export at the end of training."""
    export_dtype: str = "bf16"
    """bf16 | fp32 for exported weights."""
    max_shard_size: str = "2GB"
    """Largest safetensors file (e.g. "500MB", "5GB"): export shards, and each rank's checkpoint
    files (one such file is the extra host memory a save needs)."""
    resume: str = "none"
    """none | auto (newest complete checkpoint in run_dir, if any) | <checkpoint path>."""
    load_optimizer: bool = True
    """On resume, restore the AdamW moments too. false: weights, step and data position only,
    fresh moments (e.g. after changing optim.betas)."""

    def __post_init__(self):
        if self.every_steps < 0:
            raise ConfigError(f"checkpoint.every_steps must be >= 0 (got {self.every_steps})")
        if not (math.isfinite(self.every_minutes) and self.every_minutes >= 0):
            raise ConfigError(f"checkpoint.every_minutes must be a number of minutes >= 0, 0 = off "
                              f"(got {self.every_minutes})")
        if self.keep_last <= 0:
            raise ConfigError(f"checkpoint.keep_last must be >= 1 (got {self.keep_last})")
        if self.export_dtype not in ("bf16", "fp32"):
            raise ConfigError(f'checkpoint.export_dtype must be "bf16" or "fp32" (got "{self.export_dtype}")')
        if not self.resume:
            raise ConfigError('checkpoint.resume must be "none", "auto" or a checkpoint path')
        # The units huggingface_hub's shard splitter accepts.
        if not re.fullmatch(r"\s*0*[1-9]\d*(\.\d+)?\s*[KMGT]B\s*", self.max_shard_size, re.IGNORECASE):
            raise ConfigError(f'checkpoint.max_shard_size must be a size like "500MB" or "5GB" '
                              f'(got "{self.max_shard_size}")')


@dataclass
class WandbConfig:
    mode: Optional[str] = "auto"
    """auto | online | offline | disabled. auto: $WANDB_MODE if set (WANDB_DISABLED=true: disabled),
    else online when W&B credentials exist (WANDB_API_KEY, ~/.netrc from `wandb login`), else an
    offline run; off with a note when the wandb package is missing. online / offline / disabled set
    here win over $WANDB_MODE. offline writes <run_dir>/wandb/ (or $WANDB_DIR) for a later `wandb sync`."""
    project: str = "zerotrain"
    """W&B project the run is logged to."""
    entity: Optional[str] = None
    """W&B team or user; None = the API key's default entity."""
    name: Optional[str] = None
    """Run display name; None = the run directory's name."""
    tags: list[str] = field(default_factory=list)
    """Run tags, e.g. --logging.wandb.tags zero3,ablation."""
    group: Optional[str] = None
    """Groups related runs in the W&B UI (e.g. one sweep or one comparison)."""

    def __post_init__(self):
        if self.mode not in (None, "auto", "online", "offline", "disabled"):
            raise ConfigError(f'logging.wandb.mode must be auto, online, offline or disabled (got "{self.mode}")')
        bad = [c for c in "/\\#?%:" if c in self.project]
        if not self.project or bad:
            raise ConfigError(f'logging.wandb.project "{self.project}" must be non-empty and free of '
                              f'/ \\ # ? % : characters')
        for tag in self.tags:
            if not 1 <= len(tag) <= 64:
                raise ConfigError(f'logging.wandb.tags: "{tag}" must be 1 to 64 characters long (W&B\'s limit)')


@dataclass
class LoggingConfig:
    every_steps: int = 10
    """Log metrics (console, metrics.jsonl, W&B) every N optimizer steps."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    peak_flops: Optional[float] = None
    """Per-device peak FLOP/s for MFU (--peak-flops 989e12); None = the detected GPU's dense
    bf16 peak from train/observe/perf.py (no MFU on CPU or an unknown device)."""

    def __post_init__(self):
        if self.every_steps <= 0:
            raise ConfigError(f"logging.every_steps must be positive (got {self.every_steps})")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError(f"logging.peak_flops must be positive (got {self.peak_flops})")


@dataclass
class DistributedConfig:
    ds_config: Optional[str] = None
    """DeepSpeed JSON: ZeRO stage, offload and precision (ds_configs/ddp.json = plain DDP).
    None = the accelerate YAML's deepspeed_config_file under `accelerate launch`, else
    ds_configs/zero2.json. "auto": the fastest of ds_configs/{ddp,zero1,zero2,zero3,...}.json
    that fits this device's memory ("auto:DIR": the same file names in DIR). --ds-config on the
    command line sets it too."""
    timeout_s: int = 1800
    """Collective timeout: a rank waiting longer on a dead peer exits with an error."""
    memory_check: bool = True
    """Before building the model, compare the planner's peak per rank (train/plan/estimate.py) with what
    the device allows (GPU free memory; on CPU the memory cgroup limit or the RAM) and stop with
    the option that fits if it does not. false: skip (e.g. a model the planner cannot size)."""
    memory_margin: float = 0.1
    """Fraction of the per-rank memory kept free (estimate error, allocator cache): --ds-config
    auto chooses only options that leave it, and so does the memory check's advice; a chosen JSON
    that leaves less but fits runs with a warning. Messages state the arithmetic and the margin
    that would run an option."""
    sequence_parallel: int = 1
    """Ulysses sequence parallelism (docs/long_context.md): groups of this many consecutive ranks
    share each sample, every rank holding a contiguous 1/N of its tokens; attention trades
    sequence for heads with two all-to-alls. Activation memory per rank divides by N, the loss
    is exactly the 1-rank loss. ZeRO still partitions over the whole world; the global batch
    counts samples per data-parallel rank (world / N of them), so the data order is that of a
    run without SP. Needs a ZeRO JSON, the built-in GPT or an hf: model (sdpa attention),
    and N dividing the world size, data.seq_len and the (KV) heads. 1 = off."""

    def __post_init__(self):
        if isinstance(self.sequence_parallel, bool) or not isinstance(self.sequence_parallel, int) \
                or self.sequence_parallel < 1:
            raise ConfigError(f"distributed.sequence_parallel must be a whole number >= 1, 1 = off "
                              f"(got {self.sequence_parallel!r})")
        if self.timeout_s <= 0:
            raise ConfigError(f"distributed.timeout_s must be positive (got {self.timeout_s})")
        if not 0 <= self.memory_margin < 1:
            raise ConfigError(f"distributed.memory_margin is a fraction in [0, 1) (got {self.memory_margin})")


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self):
        if self.data.kind == "stream" and self.train.epochs:
            raise ConfigError("train.epochs: a stream (data.kind stream) has no known length before it is "
                              "tokenized; set train.max_steps instead (or `zerotrain prepare` the files first)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- loading

def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _section(tp):
    """(the dataclass, optional?) when `tp` is a section (`Optional[Section]`: null = off, e.g.
    model.lora), else (None, False)."""
    base, optional = _unwrap_optional(tp)
    return (base, optional) if dataclasses.is_dataclass(base) else (None, False)


def _type_name(tp) -> str:
    """'an integer', 'a number or null', ... for error messages."""
    tp, opt = _unwrap_optional(tp)
    names = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}
    name = names.get(tp, getattr(tp, "__name__", str(tp)))
    if typing.get_origin(tp) is tuple:
        name = f"a list of {len(typing.get_args(tp))} numbers"
    elif typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        name = "a list of mappings" if dataclasses.is_dataclass(item) else "a list of strings"
    return f"{name} or null" if opt else name


def _coerce(value, tp, key: str, from_cli: bool):
    """Check (file) or convert (CLI string) `value` to type `tp`; ConfigError names `key`."""
    base, optional = _unwrap_optional(tp)
    if value is None or (from_cli and isinstance(value, str) and value.lower() in ("null", "none")):
        if optional:
            return None
        raise ConfigError(f"{key} must be {_type_name(tp)}, not null")
    bad = ConfigError(f"{key} must be {_type_name(tp)} (got {value!r})")
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if base is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer() and not from_cli:
            return int(value)
        if from_cli and isinstance(value, str):
            try:
                f = float(value)
            except ValueError:
                raise bad from None
            if f.is_integer():
                return int(f)
        raise bad
    if base is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string; accept it as a number
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if base is str:
        if isinstance(value, str):
            return value
        raise bad
    origin = typing.get_origin(base)
    if origin in (tuple, list):
        args = typing.get_args(base)
        if dataclasses.is_dataclass(args[0]):  # a list of sections (data.sources): each built strictly
            return _section_list(value, args[0], key, from_cli)
        if from_cli and isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                value = [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise bad
        if origin is tuple:
            if len(value) != len(args):
                raise bad
            return tuple(_coerce(v, a, key, from_cli) for v, a in zip(value, args))
        return [_coerce(v, args[0], key, from_cli) for v in value]
    raise bad  # pragma: no cover - every field type is handled above


def _section_list(value, cls, key: str, from_cli: bool) -> list:
    """A list of sections (data.sources); on the command line a flow-style YAML or JSON list,
    e.g. --data.sources '[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]'."""
    if from_cli and isinstance(value, str):
        import yaml
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            value = None
    if not isinstance(value, (list, tuple)):
        first = dataclasses.fields(cls)[0].name
        raise ConfigError(f"{key} must be a list of mappings, e.g. [{{{first}: ...}}, ...] (got {value!r})")
    # (A command-line value was built when it was set; the run file's is built here.)
    return [v if isinstance(v, cls) else _build(cls, v, f"{key}[{i}].") for i, v in enumerate(value)]


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the run file'} must be a mapping (got {type(data).__name__})")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        if k not in names:
            raise ConfigError(f'unknown key "{prefix}{k}"{did_you_mean(k, names)}; '
                              f'valid keys here: {", ".join(names)}')
        tp = hints[k]
        section, optional = _section(tp)
        if section is not None:
            kwargs[k] = None if v is None and optional else _build(section, v, f"{prefix}{k}.")
        else:
            kwargs[k] = _coerce(v, tp, prefix + k, from_cli=False)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in kwargs]
    if missing:  # only list items (data.sources) have required keys
        raise ConfigError(f"{prefix}{missing[0]} is missing; each entry needs {' and '.join(required)}")
    return cls(**kwargs)


def _set_dotted(raw: dict, dotted: str, text: str):
    """Apply one CLI override to the raw dict, checking the key against the schema."""
    parts = dotted.split(".")
    cls, node = RunConfig, raw
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(cls)]
        here = ".".join(parts[:i])
        if part not in names:
            raise ConfigError(f'unknown option "--{dotted}"{did_you_mean(part, names)}; '
                              f'valid keys under {here or "the top level"}: {", ".join(names)}')
        tp = _hints(cls)[part]
        section, optional = _section(tp)
        if i == len(parts) - 1:
            if section is not None:
                if optional and text.lower() in ("null", "none"):  # an optional section switched off
                    node[part] = None
                    return
                raise ConfigError(f'"--{dotted}" is a section; set one of its keys, e.g. --{dotted}.'
                                  f"{dataclasses.fields(section)[0].name}"
                                  + (f" (or --{dotted} null to turn it off)" if optional else ""))
            node[part] = _coerce(text, tp, dotted, from_cli=True)
            return
        if section is None:
            raise ConfigError(f'"--{dotted}": {".".join(parts[:i + 1])} is not a section')
        if node.get(part) is None:  # absent, or switched off (null) in the run file: a key turns it on
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])} in the run file must be a mapping")
        cls = section


def read_mapping(path: str | Path) -> dict:
    """Parse a JSON or YAML file into a dict; syntax errors name the file, line and column."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    else:
        import yaml
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, optim, ...)")
    return data


def load_config(path: str | None = None, overrides: list[tuple[str, str]] = ()) -> RunConfig:
    """Run file (optional) + dotted overrides -> validated RunConfig."""
    raw = read_mapping(path) if path else {}
    for key, value in overrides:
        _set_dotted(raw, key, value)
    try:
        return _build(RunConfig, raw, "")
    except ConfigError as e:
        if path:
            raise ConfigError(f"{path}: {e}") from None
        raise
