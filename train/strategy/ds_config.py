"""The DeepSpeed JSON: the single source of ZeRO stage, offload and precision.

A file with a ``"ddp"`` block means plain PyTorch DDP (its keys are DDP options); a file
with ``"zero_optimization"`` means DeepSpeed. Values the trainer owns (micro-batch,
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

DDP_KEYS = ("find_unused_parameters", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "broadcast_buffers")
# DeepSpeed keys that mean nothing to plain DDP; in a ddp file they are a mistake.
DEEPSPEED_ONLY = ("zero_optimization", "offload_optimizer", "offload_param", "activation_checkpointing",
                  "zero_allow_untested_optimizer", "pipeline", "tensor_parallel")
STAGE3_ONLY = ("offload_param", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
               "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
               "stage3_module_granularity_threshold", "zero_hpz_partition_size", "zero_quantized_weights",
               "zero_quantized_nontrainable_weights", "mics_shard_size", "module_granularity_threshold",
               "sub_group_size_stage3", "sub_group_size")
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
    """What the JSON asks for, resolved against the run config."""

    path: str
    backend: str                      # "ddp" | "deepspeed"
    stage: int | None                 # ZeRO stage; None under DDP
    precision: str                    # "bf16" | "fp16" | "fp32"
    offload_optimizer: str | None     # "cpu" | "nvme" | None
    offload_param: str | None
    ddp_kwargs: dict = field(default_factory=dict)
    grad_scaler: dict | None = None   # DDP / FSDP2 fp16: torch GradScaler arguments from the "fp16" block
    precision_why: str | None = None  # how an "auto" bf16/fp16.enabled was resolved (banner); None: the JSON says
    resolved: dict = field(default_factory=dict)   # what DeepSpeed receives, no "auto" left
    settings: dict = field(default_factory=dict)   # a backend's own block as its parser read it (FSDP2's)

    @property
    def is_deepspeed(self) -> bool:
        return self.backend == "deepspeed"

    @property
    def is_zero3(self) -> bool:
        """DeepSpeed ZeRO-3: parameters partitioned across the ranks."""
        return self.is_deepspeed and self.stage == 3

    def describe(self) -> str:
        import zerotrain.train.strategy.registry as registry
        own = registry.get(self.backend).describe
        if own is not None:
            return own(self)
        if not self.is_deepspeed:
            return f"DDP ({self.precision})"
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer:
            parts.append(f"optimizer offload ({self.offload_optimizer})")
        if self.offload_param:
            parts.append(f"param offload ({self.offload_param})")
        return " + ".join(parts) + f" ({self.precision})"

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


# DeepSpeed's fp16 block as torch's GradScaler (what DDP uses): the keys that have a meaning there.
GRAD_SCALER_KEYS = {"initial_scale_power": "init_scale = 2**initial_scale_power",
                    "loss_scale_window": "growth_interval"}


def grad_scaler_args(path, fp16: dict, who: str = "DDP's GradScaler") -> dict:
    """GradScaler(init_scale, growth_interval) from a DDP file's "fp16" block (FSDP2's loss scale
    follows the same rule: `who` names it in the refusals). DeepSpeed's other knobs have no
    GradScaler equivalent (it lowers the scale at every overflow, has no floor and no static
    mode): refused unless they ask for exactly that behaviour."""
    out = {"init_scale": 2.0 ** 16, "growth_interval": 2000}  # GradScaler's own defaults but init 2**16
    for k, v in fp16.items():
        if k == "enabled":
            continue
        if k == "loss_scale":
            if v not in (0, 0.0):
                raise ConfigError(f'{path}: "fp16.loss_scale": {v!r}: {who} has no static loss scale; '
                                  f'use 0 (dynamic) or a ds_configs/zero*.json file (DeepSpeed supports static scales)')
        elif k == "hysteresis":
            if v != 1:
                raise ConfigError(f'{path}: "fp16.hysteresis": {v!r}: {who} lowers the scale at every '
                                  f"overflow (hysteresis 1); remove the key or use a ds_configs/zero*.json file")
        elif k == "initial_scale_power":
            out["init_scale"] = 2.0 ** int(v)
        elif k == "loss_scale_window":
            out["growth_interval"] = int(v)
        else:
            supported = ["enabled", "loss_scale", "hysteresis", *GRAD_SCALER_KEYS]
            raise ConfigError(f'{path}: "fp16.{k}" has no equivalent in {who}{did_you_mean(k, supported)}; '
                              f"supported: {', '.join(supported)} (min_loss_scale and the rest need a "
                              f"ds_configs/zero*.json file)")
    return out


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


def ddp_setup(path, ds: dict, precision: str, hidden_size: int | None = None, sizes_later: bool = False) -> DSSetup:
    """A "ddp" file: plain DDP with the block's options (and no DeepSpeed key). `hidden_size` and
    `sizes_later` are the registry's setup arguments (DDP has no "auto" sizes)."""
    stray = [k for k in DEEPSPEED_ONLY if k in ds]
    if stray:
        raise ConfigError(f'{path}: a "ddp" file (plain DDP) cannot also set {", ".join(stray)}; '
                          f"use a ds_configs/zero*.json file for DeepSpeed")
    ddp = ds["ddp"]
    if not isinstance(ddp, dict):
        raise ConfigError(f'{path}: "ddp" must be an object of DDP options')
    for k in ddp:
        if k not in DDP_KEYS:
            raise ConfigError(f'{path}: "ddp.{k}" is not a DDP option{did_you_mean(k, DDP_KEYS)}; '
                              f"valid: {', '.join(DDP_KEYS)}")
    return DSSetup(path=str(path), backend="ddp", stage=None, precision=precision, offload_optimizer=None,
                   offload_param=None, ddp_kwargs=dict(ddp), resolved=ds,
                   grad_scaler=grad_scaler_args(path, ds["fp16"]) if precision == "fp16" else None)


def deepspeed_setup(path, ds: dict, precision: str, hidden_size: int | None, sizes_later: bool) -> DSSetup:
    """A "zero_optimization" file (or neither block: ZeRO-0): checked, its "auto" sizes filled."""
    zero = _zero_block(path, ds)
    stage = zero.get("stage", 0)
    off_opt, off_par = _offload_devices(path, zero, stage)
    _fill_auto_sizes(path, zero, hidden_size, sizes_later)
    _grad_accum_dtype(path, ds, stage, precision)
    _check_gather_on_save(path, zero)
    if off_opt:
        # The optimizer is ours (DeepSpeedCPUAdam); DeepSpeed must not second-guess it.
        ds["zero_force_ds_cpu_optimizer"] = False
    ds["zero_allow_untested_optimizer"] = True
    left = [k for k in _find_auto(ds) if not (sizes_later and k.removeprefix("zero_optimization.") in AUTO_SIZES)]
    if left:
        raise ConfigError(f'{path}: zerotrain cannot fill "auto" for {", ".join(left)}; set concrete values')
    return DSSetup(path=str(path), backend="deepspeed", stage=stage, precision=precision, offload_optimizer=off_opt,
                   offload_param=off_par, resolved=ds)


def _zero_block(path, ds: dict) -> dict:
    """ds["zero_optimization"] (created as stage 0 when absent), its stage checked."""
    zero = ds.setdefault("zero_optimization", {"stage": 0})
    if not isinstance(zero, dict):
        raise ConfigError(f'{path}: "zero_optimization" must be an object like {{"stage": 2}}')
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f'{path}: "zero_optimization.stage" must be 0, 1, 2 or 3 (got {stage!r})')
    if stage < 3:
        bad = [k for k in STAGE3_ONLY if k in zero]
        if bad:
            raise ConfigError(f'{path}: {", ".join("zero_optimization." + k for k in bad)} only apply to ZeRO-3 '
                              f"but the file sets stage {stage}; remove them or set \"stage\": 3")
    return zero


def _offload_devices(path, zero: dict, stage: int) -> tuple[str | None, str | None]:
    """(optimizer, parameter) offload devices: "cpu", "nvme" or None."""
    off_opt = (zero.get("offload_optimizer") or {}).get("device")
    off_par = (zero.get("offload_param") or {}).get("device")
    off_opt = None if off_opt in (None, "none") else off_opt
    off_par = None if off_par in (None, "none") else off_par
    if off_opt and stage == 0:
        raise ConfigError(f'{path}: "offload_optimizer" needs ZeRO stage 1, 2 or 3 (the file sets stage 0)')
    if off_opt not in (None, "cpu", "nvme") or off_par not in (None, "cpu", "nvme"):
        raise ConfigError(f'{path}: offload "device" must be "cpu", "nvme" or "none"')
    return off_opt, off_par


def _fill_auto_sizes(path, zero: dict, hidden_size: int | None, sizes_later: bool):
    """The "auto" buffer sizes (and their companions: add_companion_sizes) from the model width
    (AUTO_SIZES); left as they are with `sizes_later`."""
    add_companion_sizes(zero)
    for k, rule in AUTO_SIZES.items():
        if is_auto(zero.get(k)):
            if hidden_size is None and sizes_later:
                continue
            if hidden_size is None:
                raise ConfigError(f'{path}: "zero_optimization.{k}" is "auto" but this model has no hidden size '
                                  f"to derive it from; set a number")
            zero[k] = rule(hidden_size)


def _check_gather_on_save(path, zero: dict):
    gather = zero.get("stage3_gather_16bit_weights_on_model_save")
    if gather is not None and gather is not True:
        raise ConfigError(f'{path}: "zero_optimization.stage3_gather_16bit_weights_on_model_save": {gather!r}: zerotrain '
                          f"never calls DeepSpeed's save_16bit_model; its exports always gather the full ZeRO-3 weights "
                          f'(checkpoint.export, zerotrain export). Remove the key (or set it true); to skip the '
                          f"export set checkpoint.export false")


ACCUM_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                "fp16": "fp16", "float16": "fp16", "half": "fp16"}


def _grad_accum_dtype(path, ds: dict, stage: int, precision: str):
    """bf16 under ZeRO-1/2/3 accumulates gradients in fp32 unless the JSON says otherwise.

    DeepSpeed's default accumulates micro-batch gradients in the parameters' dtype: in bf16
    (8 significant bits) each micro-batch's contribution is rounded into the running sum, so a
    gradient much smaller than the sum so far is lost (tests/test_zero3.py measures it).
    "data_types": {"grad_accum_dtype": "fp32"} keeps the sum in fp32 (ZeRO-1 then uses
    DeepSpeed's BF16_Optimizer). DeepSpeed 0.19 supports it from stage 1 only."""
    dt = ds.get("data_types", {})
    if not isinstance(dt, dict):
        raise ConfigError(f'{path}: "data_types" must be an object like {{"grad_accum_dtype": "fp32"}}')
    have = dt.get("grad_accum_dtype")
    if have is not None and ACCUM_DTYPES.get(str(have).lower()) is None:
        raise ConfigError(f'{path}: "data_types.grad_accum_dtype" {have!r} is not a dtype; use "fp32" or "bf16"')
    if precision == "fp16" and have is not None and ACCUM_DTYPES[str(have).lower()] == "fp32":
        raise ConfigError(f'{path}: "data_types.grad_accum_dtype": "fp32" is for bf16 (as in the shipped JSONs); '
                          f'with fp16 DeepSpeed accumulates loss-scaled fp16 gradients: remove "data_types"')
    if precision != "bf16":
        return
    if have is None and stage >= 1:
        ds["data_types"] = {**dt, "grad_accum_dtype": "fp32"}
    elif have is not None and ACCUM_DTYPES[str(have).lower()] == "fp32" and stage == 0:
        raise ConfigError(f'{path}: "data_types.grad_accum_dtype": "fp32" with bf16 needs ZeRO stage 1, 2 or 3 '
                          f"(DeepSpeed 0.19 has no fp32 accumulation at stage 0); use ds_configs/zero1.json or "
                          f'drop "data_types"')


def _find_auto(d, prefix="") -> list[str]:
    out = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _find_auto(v, f"{prefix}{k}.")
        elif is_auto(v):
            out.append(prefix + k)
    return out
