"""The strategy file (a DeepSpeed JSON): the single source of the backend, its settings and the
precision.

The block a file holds picks its backend (train/strategy/registry.py for_json): ``"ddp"`` plain
PyTorch DDP (ddp.py), ``"zero_optimization"`` (or neither) DeepSpeed ZeRO (zero.py), ``"fsdp"``
FSDP2 (fsdp2.py); each backend's parser reads its own block into its settings record, which
`DSSetup` carries. Here: what every file shares. Values the trainer owns (micro-batch,
accumulation, clipping, optimizer and scheduler hyper-parameters) are ``"auto"`` and are
filled from the run config here; a concrete value that disagrees with the run config is
an error rather than being silently overridden.

Under bf16 with ZeRO-1/2/3, gradients accumulate in fp32 ("data_types.grad_accum_dtype",
filled when the JSON does not set it). ZeRO buffer sizes may be "auto": derived from the model
width (AUTO_SIZES); a JSON that asks for one of Hugging Face's "auto" sizes gets the other
AUTO_SIZES keys it leaves out sized the same way (COMPANION_SIZES).

The same file serves Hugging Face's Trainer: "auto" appears in the shipped JSONs only where the
Trainer fills it too (tests/test_ds_hf.py), and "bf16.enabled" / "fp16.enabled" may be "auto"
(train/strategy/precision.py resolve_precision: accelerate's mixed_precision, else the
machine's fastest precision).

zerotrain builds the optimizer (torch AdamW, or DeepSpeedCPUAdam when the optimizer is
offloaded) and computes the LR itself every step, so both behave identically under DDP
and every ZeRO stage. The JSON's ``optimizer``/``scheduler`` blocks therefore select and
pin, and are removed from what DeepSpeed itself receives.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

from zerotrain.train import paths
from zerotrain.train.config import Batch, RunConfig
from zerotrain.train.errors import ConfigError, did_you_mean
from zerotrain.train.strategy.precision import check_fp16_device, fill_precision, is_auto, resolve_precision
from zerotrain.train.strategy.registry import Settings

# DeepSpeed keys that mean nothing to plain DDP; in a ddp file they are a mistake.
DEEPSPEED_ONLY = ("zero_optimization", "offload_optimizer", "offload_param", "activation_checkpointing",
                  "zero_allow_untested_optimizer", "pipeline", "tensor_parallel")
SCHEDULES = {"WarmupCosineLR": "cosine", "WarmupDecayLR": "linear", "WarmupLR": "constant"}


def _sched_type(schedule: str) -> str:
    return next(k for k, v in SCHEDULES.items() if v == schedule)


def _multiple_of_8(n: float) -> int:
    return max(8, int(n) // 8 * 8)  # DeepSpeed asserts bucket sizes align to its NCCL start alignment


# "auto" sizes from the model width h, so ZeRO's buffers scale with the model rather than being
# fixed at DeepSpeed's 5e8-element defaults (several GB: more than a 100M-parameter model's own
# states). Bucket, prefetch and persistence rules are Hugging Face's (transformers' DeepSpeed
# integration); live parameters and reuse distance hold two transformer blocks (~12 h^2 each)
# gathered, so ZeRO-3 releases what the layer after next does not need (BENCHMARKS.md).
AUTO_SIZES = {
    "reduce_bucket_size": lambda h: _multiple_of_8(h * h),
    "allgather_bucket_size": lambda h: _multiple_of_8(h * h),
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
    "stage3_max_live_parameters": lambda h: 24 * h * h,
    "stage3_max_reuse_distance": lambda h: 24 * h * h,
    "sub_group_size": lambda h: 24 * h * h,
}
# The "auto" sizes Hugging Face's Trainer fills too (transformers/integrations/deepspeed.py,
# trainer_config_finalize; tests/test_ds_hf.py). A JSON that asks for one of them has the other
# AUTO_SIZES keys of its stage that it leaves out sized from the model as well: the shipped
# JSONs say "auto" only where the Trainer fills it, and keep zerotrain's sizing of the rest.
HF_AUTO_SIZES = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
COMPANION_SIZES = {1: ("allgather_bucket_size",), 2: ("allgather_bucket_size",),
                   3: ("stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size")}
OPTIMIZERS = ("adamw", "adam")


def add_companion_sizes(zero: dict) -> list[str]:
    """Marks "auto" the COMPANION_SIZES keys a `zero_optimization` block leaves out when it has an
    "auto" HF_AUTO_SIZES key (in place); returns the keys added."""
    if not any(is_auto(zero.get(k)) for k in HF_AUTO_SIZES):
        return []
    added = [k for k in COMPANION_SIZES.get(zero.get("stage", 0), ()) if k not in zero]
    zero.update({k: "auto" for k in added})
    return added


@dataclass
class DSSetup:
    """A strategy file resolved against the run config: what every backend shares here, what its
    backend alone knows in `settings` (the backend's record, made by its parser: the registry
    entry's `setup`). A Strategy runs from it (train.strategy.for_setup) and the planner prices
    it (option.py Option.from_setup, which carries the same `settings`)."""

    #: the strategy file, as given
    path: str
    #: the registry's name of the backend whose block the file holds ("ddp" | "deepspeed" | "fsdp2")
    backend: str
    #: the training precision: "bf16" | "fp16" | "fp32"
    precision: str
    #: the backend's own settings (registry.Settings: DDPSettings, ZeroSettings, FSDP2Settings)
    settings: Settings
    #: how an "auto" bf16/fp16.enabled was resolved (the banner says it); None: the JSON says
    precision_why: str | None = None
    #: the file as the backend receives it (what DeepSpeed's engine reads), no "auto" left
    resolved: dict = field(default_factory=dict)

    def describe(self) -> str:
        """The phrase banners and errors name the file by, e.g. "ZeRO-2 (bf16)": its backend's."""
        import zerotrain.train.strategy.registry as registry
        return registry.get(self.backend).describe(self)

    @property
    def accelerate_mixed_precision(self) -> str:
        return {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[self.precision]


def read_ds_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        shipped = sorted(p.name for p in paths.DS_CONFIGS.glob("*.json"))
        raise ConfigError(f"DeepSpeed config {path} not found (--ds-config / distributed.ds_config); "
                          f"shipped configs: {', '.join('ds_configs/' + s for s in shipped)}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a JSON object")
    return data


def _match(path, ds: dict, key: str, want, what: str):
    """Fill ds[key] if "auto"/absent; else it must equal `want` (the run config's value)."""
    have = ds.get(key, "auto")
    if is_auto(have):
        ds[key] = want
        return
    same = (abs(float(have) - float(want)) <= 1e-12 * max(1.0, abs(float(want)))
            if isinstance(have, (int, float)) and not isinstance(have, bool) else have == want)
    if not same:
        raise ConfigError(f'{path}: "{key}": {have!r} contradicts the run config {what} = {want!r}; '
                          f'set it to "auto" (or to {want!r}) in the JSON, or change the run config')


def _check_block(path, block: dict, name: str, checks: dict):
    if not isinstance(block, dict):
        raise ConfigError(f'{path}: "{name}" must be an object')
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise ConfigError(f'{path}: "{name}.params" must be an object')
    for k, v in params.items():
        if k not in checks:
            raise ConfigError(f'{path}: "{name}.params.{k}" is not supported by zerotrain{did_you_mean(k, checks)}; '
                              f"supported: {', '.join(checks)}")
        want, what = checks[k]
        if is_auto(v):
            continue
        ok = (list(v) == list(want)) if isinstance(want, (list, tuple)) else (
            isinstance(v, (int, float)) and abs(float(v) - float(want)) <= 1e-12 * max(1.0, abs(float(want))))
        if not ok:
            raise ConfigError(f'{path}: "{name}.params.{k}": {v!r} contradicts the run config {what} = {want!r}; '
                              f'use "auto" or change the run config')


def load_ds_setup(path: str, cfg: RunConfig, batch: Batch | None, max_steps: int, cuda: bool,
                  hidden_size: int | None = None, sizes_later: bool = False,
                  launcher_precision: str | None = None) -> DSSetup:
    """Read the DeepSpeed JSON at `path`, validate it against the run config and fill every
    "auto". The "auto" ZeRO sizes need the model width; `sizes_later` (zerotrain check, before
    any data is read) leaves them for the run to fill. `launcher_precision`: accelerate's
    mixed_precision, for an "enabled": "auto" (default: ACCELERATE_MIXED_PRECISION). `batch`
    None (`zerotrain prepare --reference`: one process computing what the run's model computes,
    world size unknown): _fill_batch_unchecked."""
    ds = copy.deepcopy(read_ds_json(path))
    precision, why = resolve_precision(path, ds, cuda, launcher_precision)
    check_fp16_device(path, precision, cuda)
    fill_precision(ds, precision)
    if batch is not None:
        _match_batch(path, ds, cfg, batch)
    else:
        _fill_batch_unchecked(path, ds, cfg)
    _check_optimizer(path, ds, cfg.optim)
    _check_scheduler(path, ds, cfg.optim, max_steps)
    import zerotrain.train.strategy.registry as registry
    setup = registry.for_json(ds, path).setup(path, ds, precision, hidden_size, sizes_later)
    setup.precision_why = why
    return setup


def _match_batch(path, ds: dict, cfg: RunConfig, batch: Batch):
    """The batch keys and gradient clipping: filled from the run config, or equal to it."""
    _match(path, ds, "train_micro_batch_size_per_gpu", batch.micro, "train.micro_batch_size")
    _match(path, ds, "gradient_accumulation_steps", batch.accum, "train.grad_accum_steps")
    _match(path, ds, "train_batch_size", batch.global_size,
           f"global batch (micro {batch.micro} x accum {batch.accum} x world {batch.world})")
    _match(path, ds, "gradient_clipping", float(cfg.train.grad_clip), "train.grad_clip")


def _fill_batch_unchecked(path, ds: dict, cfg: RunConfig):
    """Without the world size (load_ds_setup with no batch): the batch keys left "auto" are filled
    for one process and the ones the JSON pins are kept unchecked; none of them changes what a
    forward computes, and the run checks them against its own batch at start."""
    one = cfg.train.batch(1)
    for key, value in (("train_micro_batch_size_per_gpu", one.micro), ("gradient_accumulation_steps", one.accum),
                       ("train_batch_size", one.global_size)):
        if is_auto(ds.get(key, "auto")):
            ds[key] = value
    _match(path, ds, "gradient_clipping", float(cfg.train.grad_clip), "train.grad_clip")


def _check_optimizer(path, ds: dict, o):
    """An "optimizer" block selects AdamW and pins its hyper-parameters; it is removed from `ds`."""
    if "optimizer" not in ds:
        return
    opt = ds.pop("optimizer")
    kind = str(opt.get("type", "AdamW")) if isinstance(opt, dict) else ""
    if kind.lower() not in OPTIMIZERS:
        raise ConfigError(f'{path}: "optimizer.type" {kind!r} is not supported; zerotrain builds AdamW itself '
                          f'(DeepSpeedCPUAdam under optimizer offload): use "AdamW" or remove the block')
    _check_block(path, opt, "optimizer", {"lr": (o.lr, "optim.lr"), "betas": (list(o.betas), "optim.betas"),
                                          "eps": (o.eps, "optim.eps"),
                                          "weight_decay": (o.weight_decay, "optim.weight_decay")})


def _check_scheduler(path, ds: dict, o, max_steps: int):
    """A "scheduler" block must name the run config's schedule; it is removed from `ds`."""
    if "scheduler" not in ds:
        return
    sched = ds.pop("scheduler")
    kind = sched.get("type") if isinstance(sched, dict) else None
    if kind not in SCHEDULES:
        raise ConfigError(f'{path}: "scheduler.type" {kind!r} is not supported; use one of '
                          f'{", ".join(SCHEDULES)} (zerotrain computes the LR itself) or remove the block')
    if SCHEDULES[kind] != o.schedule:
        raise ConfigError(f'{path}: "scheduler.type" {kind} means schedule "{SCHEDULES[kind]}" but the run '
                          f'config has optim.schedule = "{o.schedule}"; make them agree (--optim.schedule '
                          f'{SCHEDULES[kind]}, or a "scheduler.type" of {_sched_type(o.schedule)}, or drop the block)')
    params = sched.get("params")
    if isinstance(params, dict) and "warmup_type" in params:
        # DeepSpeed's WarmupLR/WarmupDecayLR warm up on a log curve unless "warmup_type" says
        # "linear"; zerotrain's warmup is linear (train/optim/schedule.py).
        if params["warmup_type"] != "linear":
            raise ConfigError(f'{path}: "scheduler.params.warmup_type": {params["warmup_type"]!r}: zerotrain warms '
                              f'up linearly (optim.warmup_steps); use "linear" or remove the key')
        sched = {**sched, "params": {k: v for k, v in params.items() if k != "warmup_type"}}
    _check_block(path, sched, "scheduler", {"warmup_num_steps": (o.warmup_steps, "optim.warmup_steps"),
                                            "total_num_steps": (max_steps, "train.max_steps"),
                                            "warmup_max_lr": (o.lr, "optim.lr"),
                                            "warmup_min_lr": (0.0, "warmup start (0)")})
