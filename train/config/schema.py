"""The run configuration's sections: typed dataclasses whose attribute docstrings are the
`--help` text (train/args.py) and whose __post_init__ refuses impossible values with a
ConfigError naming the key. data: (a union tagged by data.kind) is in data_section.py, model:
(a union tagged by the family model.name names) in models/config.py; keys that moved between
sections are in moved.py."""

from __future__ import annotations

import dataclasses
import keyword
import math
import re
from dataclasses import dataclass, field
from typing import Optional

from zerotrain.models.config import GptModel, ModelSection  # the model: section lives with the models (models/ needs nothing from train/)
from zerotrain.train.config.batch import Batch, split_batch
from zerotrain.train.config.data_section import DataSection, TextData
from zerotrain.train.errors import ConfigError


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


@dataclass
class DpoConfig:
    """Preference tuning (train.objective dpo) on data.kind preference: docs/workloads.md."""
    loss: str = "sigmoid"
    """sigmoid (DPO, Rafailov et al. 2023), ipo (Azar et al. 2023) or simpo (Meng et al. 2024:
    length-normalised log-probabilities, no reference model)."""
    beta: float = 0.1
    """DPO / SimPO: the reward scale beta; IPO: the regularisation tau (the margin target is 1 / (2 tau))."""
    gamma: float = 0.5
    """SimPO only: the target reward margin gamma, absolute (not a gamma / beta ratio): TRL's
    CPOConfig.simpo_gamma."""
    ipo_sum: bool = False
    """IPO only: false (the default), each sequence's log-ratio log pi - log ref is divided by its
    completion length (its response tokens), as TRL's DPOTrainer computes loss_type "ipo"; true,
    summed over the completion (Azar et al.'s sampled form as written: zerotrain's IPO before)."""
    reference: str = "live"
    """Where the reference log-probabilities come from (sigmoid, ipo): "live", computed in the
    same step without gradient, under model.lora by the same model with its adapters off (no
    extra memory), else by a frozen copy of the initial model (one more copy of the weights per
    rank; not under ZeRO-3, whose parameters are partitioned); or "precomputed", read from
    <data.path stem>.reference.safetensors (and the validation file's), written once by
    `zerotrain prepare --reference` with the run's model at its starting weights, computed as the
    run's strategy file computes (its precision; prepare's --strategy): no reference forward and
    no copy, so full fine-tuning has a reference under ZeRO-3 too."""

    def __post_init__(self):
        if self.loss not in ("sigmoid", "ipo", "simpo"):
            raise ConfigError(f'train.dpo.loss must be sigmoid, ipo or simpo (got "{self.loss}")')
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ConfigError(f"train.dpo.beta must be a number > 0 (got {self.beta})")
        if not (self.gamma >= 0 and math.isfinite(self.gamma)):
            raise ConfigError(f"train.dpo.gamma must be a number >= 0 (got {self.gamma})")
        if self.reference not in ("live", "precomputed"):
            raise ConfigError(f'train.dpo.reference must be "live" or "precomputed" (got "{self.reference}")')


@dataclass
class EmaConfig:
    """train.ema: an exponential moving average of the trained weights (docs/features.md#ema)."""
    decay: float = 0.999
    """ema = decay x ema + (1 - decay) x weights at each update; in (0, 1). The average spans
    about 1 / (1 - decay) updates."""
    every_steps: int = 1
    """Update every N optimizer steps (the average then spans N / (1 - decay) steps)."""
    evaluate: bool = True
    """At each evaluation also evaluate the EMA weights, logged as val_ema/* (train.early_stop
    may watch them)."""

    def __post_init__(self):
        if isinstance(self.decay, bool) or not isinstance(self.decay, (int, float)) or not 0 < self.decay < 1:
            raise ConfigError(f"train.ema.decay must be a number in (0, 1), e.g. 0.999 (got {self.decay!r})")
        if self.every_steps <= 0:
            raise ConfigError(f"train.ema.every_steps must be a positive integer (got {self.every_steps})")


@dataclass
class EarlyStopConfig:
    """train.early_stop: stop when an evaluated metric stops improving (docs/features.md#early-stopping)."""
    metric: str = "val/loss"
    """The evaluation metric watched: val/<name> (or val_ema/<name> with train.ema.evaluate)."""
    patience: int = 3
    """Stop after this many evaluations in a row without an improvement."""
    min_delta: float = 0.0
    """An improvement must beat the best value so far by more than this."""
    mode: str = "min"
    """min (a loss) or max (an accuracy)."""

    def __post_init__(self):
        if self.patience <= 0:
            raise ConfigError(f"train.early_stop.patience must be a positive number of evaluations (got {self.patience})")
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0):
            raise ConfigError(f"train.early_stop.min_delta must be a number >= 0 (got {self.min_delta})")
        if self.mode not in ("min", "max"):
            raise ConfigError(f'train.early_stop.mode must be "min" or "max" (got "{self.mode}")')
        if not self.metric.startswith(("val/", "val_ema/")):
            raise ConfigError(f'train.early_stop.metric "{self.metric}": early stopping watches an evaluation '
                              f'metric, val/<name> (e.g. val/loss) or val_ema/<name>')


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
    """Evaluate every N optimizer steps (0 = only at the end of a run that completes). To switch
    evaluation off, set train.eval_batches 0."""
    eval_batches: Optional[int] = 20
    """Validation micro-batches per process per evaluation (None = the whole validation set;
    0 = no evaluation at all: no val/* metrics, not even at the end, and the banner says "no
    validation"). Records held out by data.val_fraction stay out of training either way: set
    data.val_fraction 0 to train on them."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping). The logged norm is pre-clip."""
    run_dir: str = "runs/default"
    """Where config, metrics.jsonl, checkpoints and exported weights go."""
    sample_tokens: int = 200
    """LM: bytes/tokens generated as a sample at the end (0 = none)."""
    nan_policy: str = "skip"
    """On a NaN/Inf loss: "skip" the step (counted) or "stop" (checkpoint the last good state)."""
    objective: str = "lm"
    """What is trained: "lm" (the model's own loss: next-token cross-entropy on language-model
    data, or the task's loss) or "dpo" (preference tuning on data.kind preference, train.dpo)."""
    dpo: DpoConfig = field(default_factory=DpoConfig)
    """train.objective dpo: the preference loss, beta, gamma and the reference."""
    ema: Optional[EmaConfig] = None
    """An exponential moving average of the weights, kept sharded like the optimizer's moments and
    saved in checkpoints (null = off); e.g. --train.ema.decay 0.999."""
    early_stop: Optional[EarlyStopConfig] = None
    """Stop when train.early_stop.metric has not improved for `patience` evaluations (null = off);
    e.g. --train.early_stop.patience 3. The run then saves, exports and exits 0."""
    max_bad_steps: int = 5
    """Stop after this many consecutive non-finite steps, whatever nan_policy says. Both are
    decided at each log line (logging.every_steps) and before each checkpoint, where the trainer
    reads the gradient norms it kept on the device: skipped steps never touch the weights, so a
    stop can come up to logging.every_steps steps after its cause and still saves the last good state."""

    def __post_init__(self):
        for k in ("micro_batch_size", "max_steps"):
            if getattr(self, k) <= 0:
                raise ConfigError(f"train.{k} must be a positive integer (got {getattr(self, k)})")
        for k in ("grad_accum_steps", "global_batch_size", "epochs"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ConfigError(f"train.{k} must be a positive integer or null (got {v})")
        if self.eval_batches is not None and self.eval_batches < 0:
            raise ConfigError(f"train.eval_batches must be >= 0 (0 = no evaluation) or null (got {self.eval_batches})")
        if self.eval_every < 0:
            raise ConfigError(f"train.eval_every must be >= 0 (got {self.eval_every})")
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (got {self.grad_clip})")
        if self.sample_tokens < 0:
            raise ConfigError(f"train.sample_tokens must be >= 0 (got {self.sample_tokens})")
        if self.nan_policy not in ("skip", "stop"):
            raise ConfigError(f'train.nan_policy must be "skip" or "stop" (got "{self.nan_policy}")')
        if self.objective not in ("lm", "dpo"):
            raise ConfigError(f'train.objective must be "lm" or "dpo" (got "{self.objective}")')
        if self.max_bad_steps <= 0:
            raise ConfigError(f"train.max_bad_steps must be positive (got {self.max_bad_steps})")

    def batch(self, world_size: int) -> Batch:
        """Resolve micro x accumulation x world = global for `world_size` processes (batch.py)."""
        return split_batch(self.micro_batch_size, self.grad_accum_steps, self.global_batch_size, world_size)


@dataclass
class HardwareConfig:
    """How this machine runs the step: compiler, matmul precision, host allocator. None of it
    changes what is trained (the same losses up to floating-point rounding)."""
    compile: bool = False
    """torch.compile the model (TorchInductor) before wrapping it: fused kernels, usually faster
    steps on GPU after a compile of tens of seconds to minutes at the first step. Off by default
    (compile time; on CPU it needs a C++ compiler). DDP, ZeRO-0/1/2; refused with ZeRO-3, whose
    parameter gathering hooks break compiled graphs."""
    tf32: bool = True
    """CUDA: fp32 matmuls and convolutions use TensorFloat-32 tensor cores (inputs rounded to a
    10-bit mantissa, fp32 accumulation; several times the fp32 rate on Ampere and newer), as
    PyTorch's "high" float32 matmul precision. Affects fp32 runs only (bf16/fp16 use their own units);
    false = full fp32. Without a GPU there is nothing to set."""
    host_malloc: str = "auto"
    """Host memory allocator on a CPU-only machine: "compact" returns every freed block of 1 MiB
    or more to the OS at once (resident memory follows live tensors, at a cost in step time:
    BENCHMARKS.md "Host allocator on CPU"), "glibc" keeps glibc's default (freed blocks stay
    resident for reuse, fastest). "auto" = glibc, unless the memory check finds the run would not
    fit without compact (train/launch/host_settings.py; the banner then says so). MALLOC_MMAP_THRESHOLD_ in the
    environment wins."""

    def __post_init__(self):
        if self.host_malloc not in ("auto", "compact", "glibc"):
            raise ConfigError(f'hardware.host_malloc must be "auto", "compact" or "glibc" (got "{self.host_malloc}")')


@dataclass
class DebugConfig:
    """Diagnostics that cost time or disk; off by default."""
    trace_data: bool = False
    """Debug: every rank appends a fingerprint (crc32) of each sample it trains on to
    <run_dir>/ranks/rank<R>.data.jsonl, to verify sharding and resume order."""
    param_checksum: bool = False
    """After every optimizer step, log debug/param_checksum: a checksum of every parameter as
    the step left it (Strategy.param_checksum; under ZeRO-3 each parameter is gathered, a
    collective and a host read per step), and debug/update_checksum, the checksum of what the
    steps changed since step 1 (1-process runs also debug/update_sq, its scale, from a host copy
    of the weights); before step 1, <run_dir>/param_groups.json (the optimizer's groups).
    `zerotrain verify` turns it on to compare strategies."""
    reverse_micro_batches: bool = False
    """Run each optimizer step's micro-batches in reverse order: the same samples and the same
    gradient, summed in another order (floating-point rounding only; with 3 or more micro-batches
    a step, since a + b = b + a exactly). `zerotrain verify` uses it for its rounding-floor
    reference (docs/troubleshooting.md#zerotrain-verify)."""
    collectives: bool = False
    """Check, before every collective, that every rank runs the same one (operation, shapes,
    dtypes): torch's TORCH_DISTRIBUTED_DEBUG=DETAIL wrapper around the process group. A mismatch
    (an all-reduce on some ranks only, a tensor of another shape, a save or an evaluation on one
    rank) stops every rank within seconds with one line naming the operation, the shapes, the
    step and the ranks; a rank that does not come to a collective within
    collectives_timeout_s (after the first step; distributed.timeout_s before) is named, and
    prints its Python stack. Costs a barrier and a small
    all-gather per collective (BENCHMARKS.md "Collective checks"), so off by default;
    `zerotrain verify` turns it on. Set before the process group starts: in the run file or on
    the command line, not later."""
    collectives_timeout_s: int = 20
    """With debug.collectives: the collective timeout (instead of distributed.timeout_s) from the
    end of the run's first step on, so that a rank that never arrives is named within this time.
    Start-up and the first step keep distributed.timeout_s: ranks far apart there (slow imports,
    a data prepare on rank 0 only, a first step that compiles) are not stopped. Raise it where one
    rank is legitimately away from the others for longer later on (a large save or export, a slow
    evaluation)."""

    def __post_init__(self):
        if isinstance(self.collectives_timeout_s, bool) or not isinstance(self.collectives_timeout_s, int) \
                or self.collectives_timeout_s <= 0:
            raise ConfigError(f"debug.collectives_timeout_s must be a positive number of seconds "
                              f"(got {self.collectives_timeout_s!r})")


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
    export_weights: str = "live"
    """live | ema: which weights the end-of-run export writes (ema needs train.ema)."""
    max_shard_size: str = "2GB"
    """Largest safetensors file (e.g. "500MB", "5GB"): export shards, and each rank's checkpoint
    files (one such file is the extra host memory a save needs)."""
    resume: str = "none"
    """none | auto (newest complete checkpoint in run_dir, if any) | <checkpoint path>."""
    load_optimizer: bool = True
    """On resume, restore the AdamW moments too. false: weights, step and data position only,
    fresh moments (e.g. after changing optim.betas)."""
    async_: bool = False
    """Key `async` (the field is async_: `async` is a Python keyword). true: a save copies each
    rank's state into host memory at the step boundary (pinned, on a side stream, on a GPU) and
    writes it in a background thread while training goes on; the next save waits only if that
    write is still running (logged), and `latest` moves only once every rank's files are durable.
    A failed write (disk full) is one warning line: the previous checkpoint stays, the next save
    tries again. Costs host memory the size of the rank's share of the checkpoint (~12 bytes x
    parameters / processes), which the memory plan counts: on a CPU, where it would not fit the
    budget, the run saves synchronously (one banner line). Lifecycle: docs/checkpoints.md.
    Default false, from the measurement (BENCHMARKS.md "Asynchronous checkpoint saves"): it cuts
    the loop's blocked time per save to the copy into host memory, but on a CPU the write runs on
    the cores training uses (the steps it overlaps may run slower), every rank keeps its share of
    the checkpoint in memory all run long (on a CPU the memory that bounds the model size), a
    failed write becomes a warning instead of an error, and the CUDA path is not measured yet.
    Turn it on where a save is long against the step and the host has the RAM (GPU nodes)."""

    def __post_init__(self):
        if self.every_steps < 0:
            raise ConfigError(f"checkpoint.every_steps must be >= 0 (got {self.every_steps})")
        if not (math.isfinite(self.every_minutes) and self.every_minutes >= 0):
            raise ConfigError(f"checkpoint.every_minutes must be a number of minutes >= 0, 0 = off "
                              f"(got {self.every_minutes})")
        if self.keep_last <= 0:
            raise ConfigError(f"checkpoint.keep_last must be >= 1 (got {self.keep_last})")
        if self.export_weights not in ("live", "ema"):
            raise ConfigError(f'checkpoint.export_weights must be "live" or "ema" (got "{self.export_weights}")')
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
    """auto | online | offline | disabled; online / offline / disabled set here win over the
    environment. auto follows wandb's own rules (docs/observability.md): WANDB_DISABLED=true: disabled;
    else the mode wandb's settings give ($WANDB_MODE over `wandb offline`'s settings file); wandb's
    default, online, only when wandb finds credentials (`wandb login`, WANDB_API_KEY), else an offline
    run; off with a note when the wandb package is missing. offline writes <run_dir>/wandb/ (or
    $WANDB_DIR) for a later `wandb sync`. Used when logging.trackers lists wandb."""
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
    """Log metrics (console and logging.trackers) every N optimizer steps."""
    trackers: list[str] = field(default_factory=lambda: ["jsonl", "wandb"])
    """Where metrics go, Accelerate trackers on rank 0: jsonl (<run_dir>/metrics.jsonl), wandb
    (logging.wandb), tensorboard (<run_dir>/tensorboard), mlflow ($MLFLOW_TRACKING_URI, else a file
    store in <run_dir>/mlruns), e.g. --logging.trackers jsonl,tensorboard. A listed tracker whose
    package is missing stops the run before the model is built (exit 2)."""
    progress: bool = True
    """Show the tqdm progress bar (main process only); false: one plain line per logging interval."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    peak_flops: Optional[float] = None
    """Per-device peak FLOP/s for MFU (--peak-flops 989e12); None = the detected GPU's dense
    bf16 peak from train/observe/perf.py (no MFU on CPU or an unknown device)."""

    def __post_init__(self):
        if self.every_steps <= 0:
            raise ConfigError(f"logging.every_steps must be positive (got {self.every_steps})")
        known = ("jsonl", "wandb", "tensorboard", "mlflow")  # train/observe/trackers.py NAMES
        bad = [t for t in self.trackers if t not in known]
        if bad or len(set(self.trackers)) != len(self.trackers):
            raise ConfigError(f"logging.trackers {','.join(self.trackers)}: "
                              + (f'unknown tracker "{bad[0]}"' if bad else "a tracker listed twice")
                              + f"; choose from {', '.join(known)}, e.g. --logging.trackers jsonl,wandb")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise ConfigError(f"logging.peak_flops must be positive (got {self.peak_flops})")


@dataclass
class DistributedConfig:
    ds_config: Optional[str] = None
    """The strategy file: backend, ZeRO stage, offload and precision (ds_configs/ddp.json = plain
    DDP, zero*.json = DeepSpeed, fsdp2*.json = FSDP2).
    None = the accelerate YAML's deepspeed_config_file under `accelerate launch`, else
    ds_configs/zero2.json. "auto": the fastest of ds_configs/{ddp,zero1,zero2,zero3,...}.json
    that fits this device's memory ("auto:DIR": the same file names in DIR; FSDP2 files are not
    candidates). --strategy (or --ds-config) on the command line sets it too."""
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
    model: ModelSection = field(default_factory=GptModel)
    """One variant per model family, picked by model.name (models/config.py)."""
    data: DataSection = field(default_factory=TextData)
    """One variant per data.kind (data_section.py)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def __post_init__(self):
        if (self.train.objective == "dpo") != (self.data.kind == "preference"):
            raise ConfigError("train.objective dpo trains on data.kind preference and that data on it only; "
                              + ("set data.kind preference" if self.train.objective == "dpo"
                                 else "set train.objective dpo"))
        if self.train.objective == "dpo" and self.distributed.sequence_parallel > 1:
            raise ConfigError("train.objective dpo does not run with distributed.sequence_parallel yet; set it to 1")
        if self.checkpoint.export_weights == "ema" and self.train.ema is None:
            raise ConfigError("checkpoint.export_weights ema: the run keeps no EMA; set train.ema (e.g. "
                              "--train.ema.decay 0.999) or export the live weights")
        es = self.train.early_stop
        off = "train.eval_batches 0" if self.train.eval_batches == 0 else \
            "data.val_fraction 0" if getattr(self.data, "val_fraction", None) == 0 else None
        if es is not None and off:
            raise ConfigError(f'train.early_stop.metric "{es.metric}" is never logged: evaluation is off '
                              f"({off}); turn evaluation on or remove train.early_stop")
        if es is not None and es.metric.startswith("val_ema/") and (self.train.ema is None or not self.train.ema.evaluate):
            raise ConfigError(f'train.early_stop.metric "{es.metric}" is never logged: it needs train.ema with '
                              f"train.ema.evaluate true")
        if self.data.kind == "stream" and self.train.epochs:
            raise ConfigError("train.epochs: a stream (data.kind stream) has no known length before it is "
                              "tokenized; set train.max_steps instead (or `zerotrain prepare` the files first)")

    def to_dict(self) -> dict:
        """The resolved config under the run file's keys (checkpoint.async, not async_)."""
        def keys(x):
            if isinstance(x, dict):
                return {(k[:-1] if k.endswith("_") and keyword.iskeyword(k[:-1]) else k): keys(v) for k, v in x.items()}
            return [keys(v) for v in x] if isinstance(x, list) else x
        return keys(dataclasses.asdict(self))
