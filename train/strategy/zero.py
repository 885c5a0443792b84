"""DeepSpeed ZeRO, stages 0-3, with optimizer / parameter offload (a ds_configs JSON with
"zero_optimization"): the engine clips, steps and keeps its own fp16 loss scale and counters;
ZeRO-3 builds the model partitioned."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

import zerotrain.train.strategy.cost as cost
import zerotrain.train.strategy.ds_config as ds_config
import zerotrain.train.strategy.internals as internals
import zerotrain.train.strategy.loss_scale as loss_scale
import zerotrain.train.strategy.registry as registry
from zerotrain.models.partitioned import PartitionedInit
from zerotrain.train import testhooks
from zerotrain.train.errors import ConfigError
from zerotrain.train.strategy.base import HALF_DTYPES, Strategy
from zerotrain.train.strategy.option import Option
from zerotrain.train.strategy.precision import is_auto

# Strategy.malloc_figures by stage, from the cgroup peaks of BENCHMARKS.md "Host allocator on CPU".
# ZeRO-0/1 hold the same flat buffers as ZeRO-2.
GLIBC_GROWTH = {0: 1.05, 1: 1.05, 2: 1.05, 3: 1.50}
COMPACT_COST = {0: 0.11, 1: 0.11, 2: 0.11, 3: 0.62}
# DeepSpeed 0.19's zero_optimization defaults (deepspeed/runtime/zero/config.py).
ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "contiguous_gradients": True,
                 "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                 "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9}
STAGE3_ONLY = ("offload_param", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
               "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
               "stage3_module_granularity_threshold", "zero_hpz_partition_size", "zero_quantized_weights",
               "zero_quantized_nontrainable_weights", "mics_shard_size", "module_granularity_threshold",
               "sub_group_size_stage3", "sub_group_size")
ACCUM_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                "fp16": "fp16", "float16": "fp16", "half": "fp16"}


@dataclass(frozen=True)
class ZeroSettings(registry.Settings):
    """What DeepSpeed ZeRO alone reads from a strategy file: its "zero_optimization" block and the
    gradient accumulation dtype ("data_types"). Made by `setup` (a run's resolved file) and
    `_option` / `_default_option` (the planner's reading of a file), both through `_settings`."""

    #: the ZeRO stage: 0-3
    stage: int
    #: where the optimizer states are offloaded ("cpu", "nvme"); None: kept on the device
    offload_optimizer: Optional[str] = None
    #: where the parameters are offloaded (ZeRO-3: "cpu", "nvme"); None: kept on the device
    offload_param: Optional[str] = None
    #: the "zero_optimization" block with its buffer sizes as a run has them; an "auto" size no
    #: model width filled is left out, so DeepSpeed's default stands in (`size`)
    block: dict = field(default_factory=dict)
    #: 16-bit training accumulating gradients in fp32 ("data_types.grad_accum_dtype", which a run
    #: fills for bf16 from stage 1: _grad_accum_dtype)
    grad_accum_fp32: bool = False

    @property
    def zero_stage(self) -> Optional[int]:
        return self.stage

    def size(self, key: str) -> float:
        """A buffer size of the block (elements), DeepSpeed's default where it has none."""
        return float(self.block.get(key, ZERO_DEFAULTS.get(key, 0)))

    @property
    def overlap_comm(self) -> bool:
        """Reduction overlapped with backward (doubles the reduce buckets): DeepSpeed's default is
        on at stage 3 only."""
        return bool(self.block.get("overlap_comm", self.stage == 3))


# ------------------------------------------------------------------ the file's block
def setup(path, ds: dict, precision: str, hidden_size: Optional[int], sizes_later: bool):
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
    left = [k for k in _find_auto(ds)
            if not (sizes_later and k.removeprefix("zero_optimization.") in ds_config.AUTO_SIZES)]
    if left:
        raise ConfigError(f'{path}: zerotrain cannot fill "auto" for {", ".join(left)}; set concrete values')
    settings, _ = _settings(zero, precision, ds.get("data_types"), stage=stage)
    return ds_config.DSSetup(path=str(path), backend="deepspeed", precision=precision, settings=settings, resolved=ds)


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


def _offload_devices(path, zero: dict, stage: int) -> tuple[Optional[str], Optional[str]]:
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


def _fill_auto_sizes(path, zero: dict, hidden_size: Optional[int], sizes_later: bool):
    """The "auto" buffer sizes (and their companions: add_companion_sizes) from the model width
    (AUTO_SIZES); left as they are with `sizes_later`."""
    ds_config.add_companion_sizes(zero)
    for k, rule in ds_config.AUTO_SIZES.items():
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


def describe(ds) -> str:
    """e.g. "ZeRO-3 + optimizer offload (cpu) + param offload (cpu) (bf16)"."""
    z = ds.settings
    parts = [f"ZeRO-{z.stage}"]
    if z.offload_optimizer:
        parts.append(f"optimizer offload ({z.offload_optimizer})")
    if z.offload_param:
        parts.append(f"param offload ({z.offload_param})")
    return " + ".join(parts) + f" ({ds.precision})"


class ZeroStrategy(Strategy):
    backend = "deepspeed"
    @property
    def stage(self) -> int:
        return self.ds.settings.stage

    def record(self) -> dict:
        return {"backend": self.backend, "zero_stage": self.stage, "precision": self.precision}

    @property
    def partitions_parameters(self) -> bool:
        return self.stage == 3

    # ------------------------------------------------------------------ checks and build
    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if cfg.hardware.compile and self.partitions_parameters:
            raise ConfigError(f"hardware.compile with ZeRO-3 ({self.path}): DeepSpeed's parameter gathering hooks break "
                              f"compiled graphs; use ZeRO-0/1/2 or DDP, or set hardware.compile false")

    def check_channels_last(self, cfg, want: Optional[bool], family: str, cuda: bool) -> bool:
        """DeepSpeed copies every parameter into its flat (contiguous, NCHW) buffers, which undoes
        the layout."""
        if want:
            raise ConfigError(f"model.channels_last: DeepSpeed ({self.describe()}) keeps parameters in flat "
                              f"contiguous buffers, which undoes the channels-last layout; use ds_configs/ddp.json "
                              f"or remove it")
        return False

    def check_frozen_copy(self, what: str) -> None:
        if self.partitions_parameters:
            raise ConfigError(f"{what} needs a reference model; under ZeRO-3 full fine-tuning has no "
                              f"frozen copy (its parameters are partitioned): add model.lora (the reference is then "
                              f"the base, adapters off), use ZeRO-0/1/2 or DDP, or train.dpo.loss simpo")

    def build_accelerator(self, batch, timeout_s: int):
        from accelerate.utils import DeepSpeedPlugin

        from zerotrain.train.launch.distributed import build_accelerator
        plugin = DeepSpeedPlugin(hf_ds_config=self.ds.resolved, zero3_init_flag=self.partitions_parameters)
        return build_accelerator(self.ds.accelerate_mixed_precision, batch, timeout_s, deepspeed_plugin=plugin)

    def make_leaf_modules(self, model, classes) -> bool:
        """ZeRO-3 leaf modules (deepspeed.utils.set_z3_leaf_modules): a block's parameters are
        gathered as one unit when it starts, so ranks whose tokens reach different experts still
        issue the same collectives (models/moe.py)."""
        if not self.partitions_parameters:
            return False
        from deepspeed.utils import set_z3_leaf_modules
        set_z3_leaf_modules(model, list(classes))
        return True

    def init_context(self):
        """Build the model already partitioned under ZeRO-3 (a model larger than one device's
        memory never exists whole); an ordinary construction otherwise."""
        if not self.partitions_parameters:
            return super().init_context()
        return ZeroInit(self.ds.resolved)

    def build_optimizer(self, model, optim_cfg):
        from zerotrain.train.optim.optimizer import adamw, groups_and_args
        if self.ds.settings.offload_optimizer:
            # DeepSpeedCPUAdam in AdamW mode, the optimizer ZeRO offload steps on the host, over
            # the same groups and arguments. It JIT-builds once (`make ops` ahead: docs/machine_notes.md).
            from deepspeed.ops.adam import DeepSpeedCPUAdam
            groups, kw = groups_and_args(model, optim_cfg)
            return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
        return adamw(model, optim_cfg, fused=None)  # DeepSpeed steps its own flat partitions: torch's default

    def after_prepare(self, workload) -> dict:
        facts = {}
        if self.precision != "fp32":
            workload.keep_norm_stats_fp32(self.engine)  # 16-bit parameters, fp32 BatchNorm statistics
        if testhooks.fire("plant_decay_all", world=self.acc.num_processes):  # zerotrain verify's tests
            wd = max(g["weight_decay"] for g in self.raw_optimizer.param_groups)
            for g in self.raw_optimizer.param_groups:  # norms and biases decay too
                g["weight_decay"] = wd
        if not self.partitions_parameters and testhooks.fire("plant_drop_partition", world=self.acc.num_processes,
                                                             rank=self.acc.process_index):
            internals.drop_partition_gradients(self.engine.optimizer)  # zerotrain verify's tests
        if self.partitions_parameters:
            from zerotrain.models import partition_counts
            facts["zero3"] = partition_counts(workload.model)
        return facts

    def frozen_like_policy(self, module: torch.nn.Module) -> torch.nn.Module:
        """DeepSpeed bf16/fp16 casts the whole model to 16 bits (module.half()/.bfloat16() when
        the engine is made: parameters and floating buffers): the frozen module (built in fp32) is
        cast the same way, so it computes as the model did before its first step
        (Strategy.frozen_like_policy; the dtype from the strategy file, no engine needed)."""
        dtype = HALF_DTYPES.get(self.precision)
        return module.to(dtype) if dtype is not None else module

    def compute_form(self, device_type: str) -> str:
        if self.precision == "fp32":
            return "fp32"
        return f"{self.precision} parameters and buffers (deepspeed) on {device_type}"

    # ------------------------------------------------------------------ one step
    def input_dtype(self) -> Optional[torch.dtype]:
        """DeepSpeed bf16/fp16 keeps the parameters themselves in 16 bits."""
        dtype = next(p for p in self.engine.parameters()).dtype
        return None if dtype == torch.float32 else dtype

    def backward(self, loss) -> None:
        if testhooks.fire("plant_grad_times_world", world=self.acc.num_processes):  # zerotrain verify's tests
            loss = loss * self.acc.num_processes
        groups = self.raw_optimizer.param_groups
        if testhooks.fire("plant_lr_behind", world=self.acc.num_processes):  # zerotrain verify's tests
            last_set, used = getattr(self, "_planted_lr", (0.0, 0.0))  # (the trainer's last LR, the one used)
            if groups[0]["lr"] != used:  # the trainer set a new step's LR: run the one before it
                last_set, used = groups[0]["lr"], last_set
                self._planted_lr = (last_set, used)
            for g in groups:
                g["lr"] = used
        if self.partitions_parameters and testhooks.fire("plant_wd_off", world=self.acc.num_processes):
            decays = [g["weight_decay"] for g in groups]  # zerotrain verify's tests: the step without decay
            for g in groups:
                g["weight_decay"] = 0.0
            super().backward(loss)
            for g, wd in zip(groups, decays):
                g["weight_decay"] = wd
            return
        super().backward(loss)

    def step(self, clip: float):
        # The engine already unscaled, clipped and stepped inside backward().
        norm = self.engine.get_global_grad_norm()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def param_checksum(self, origin: list | None = None) -> tuple[float, float, float]:
        """ZeRO-3 holds 1/world of each parameter: gathered one at a time (every rank), so the
        checksum covers the whole model with one parameter's extra memory (`origin`: the base
        class's, a whole copy)."""
        if not self.partitions_parameters:
            return super().param_checksum(origin)
        import deepspeed
        from zerotrain.train.strategy.base import _origin_of, param_projection
        total, offset = torch.zeros(3, dtype=torch.float64), 0
        for i, p in enumerate(self.engine.parameters()):
            with deepspeed.zero.GatheredParameters([p]):
                total = total + param_projection(p, offset, _origin_of(origin, i, p))
                offset += p.numel()
        return float(total[0]), float(total[1]), float(total[2])

    # ------------------------------------------------------------------ fp16 and counters
    @property
    def loss_scale_floor(self) -> float:
        return float(self.ds.resolved.get("fp16", {}).get("min_loss_scale", 1))

    def loss_scale(self):
        if self.precision != "fp16":
            return None
        return loss_scale.current(optimizer=self.engine.optimizer)

    def counts_skipped_steps(self) -> bool:
        return True

    def engine_skipped_steps(self) -> Optional[int]:
        return internals.skipped_steps(self.engine)

    def state_dict(self) -> dict:
        out = {"counters": internals.engine_counters(self.engine)}
        if self.precision == "fp16":
            out["loss_scaler"] = {"kind": "deepspeed", **loss_scale.state(self.engine.optimizer)}
        return out

    def load_state_dict(self, state: dict, at) -> None:
        """The engine's counters as saved; for a record without them (another backend's, an
        import's), from the TrainState `at`. micro_steps is always the step's: the engine's
        accumulation boundary counts from it, with this run's accumulation."""
        counters = state.get("counters") or {}
        accum = int(self.ds.resolved["gradient_accumulation_steps"])
        internals.set_engine_counters(self.engine, global_steps=counters.get("global_steps", at.step),
                                      global_samples=counters.get("global_samples", at.samples_seen),
                                      skipped_steps=counters.get("skipped_steps", at.skipped_steps),
                                      micro_steps=at.step * accum)
        s = state.get("loss_scaler")
        if s and self.precision == "fp16" and s.get("kind") == "deepspeed":
            loss_scale.restore(self.engine.optimizer, s)

    # ------------------------------------------------------------------ checkpoints and memory
    def make_holder(self, raw_model, rank: int, world: int):
        from zerotrain.train.strategy.holders import Zero3Holder, for_zero12
        opt = self.engine.optimizer
        if self.partitions_parameters:
            return Zero3Holder(raw_model, opt, rank, world)
        return for_zero12(raw_model, opt, rank, world)

    def uses_shm_buffers(self) -> bool:
        return internals.shm_comm_in_use()

    def step_target(self):
        return self.engine.optimizer

    @property
    def malloc_figures(self) -> tuple[float, float]:
        return GLIBC_GROWTH[self.stage], COMPACT_COST[self.stage]


class ZeroInit(PartitionedInit):
    """ZeRO-3's construction for the model builders (models/partitioned.py): deepspeed.zero.Init
    with the run's resolved JSON, DeepSpeed's gather, its parameters' status."""

    def __init__(self, config: dict):
        self.config = config

    def __call__(self):
        import deepspeed  # deferred: a DDP run never imports DeepSpeed (start-up time)
        return deepspeed.zero.Init(config_dict_or_path=self.config)

    def partitioned(self, params) -> list:
        return [p for p in params if hasattr(p, "ds_id")]

    def needs_gather(self, tensor) -> bool:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        return getattr(tensor, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE

    def gathered(self, params, modifier_rank=None):
        import deepspeed
        return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


# ------------------------------------------------------------------ the registry entry
def _option(label: str, path, precision: str, ds: dict, width=None) -> Option:
    """A DeepSpeed file as the planner prices it: its ZeRO block, sized as a run sizes it."""
    return _zero_option(label, path, precision, dict(ds.get("zero_optimization") or {"stage": 0}),
                        ds.get("data_types"), width)


def _default_option(label: str, fname: str, precision: str) -> Option:
    """DeepSpeed's defaults for a shipped file's name (zero2.json, zero3_offload.json, ...)."""
    stage = int(fname[4])
    zero = {"stage": stage}
    if "offload" in fname:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return _zero_option(label, None, precision, zero)


def _zero_option(label, path, precision, zero, data_types=None, width=None) -> Option:
    settings, notes = _settings(zero, precision, data_types, width)
    return Option(label, path, "deepspeed", precision, settings, notes=tuple(dict.fromkeys(notes)))


def _settings(zero: dict, precision: str, data_types=None, width=None, stage=None) -> tuple[ZeroSettings, list]:
    """A "zero_optimization" block read into ZeroSettings, and the planner's notes on the reading:
    its "auto" sizes filled from the model width `width` as a run fills them, or (no width)
    left to DeepSpeed's defaults. `stage`: the block's, as a run's setup checked it."""
    def device(block):
        d = (zero.get(block) or {}).get("device")
        return None if d in (None, "none") else d
    zero = dict(zero)
    notes = []
    ds_config.add_companion_sizes(zero)  # as setup sizes them for a run
    for k, v in list(zero.items()):
        if isinstance(v, str) and v.lower() == "auto":
            if width and k in ds_config.AUTO_SIZES:
                zero[k] = ds_config.AUTO_SIZES[k](width)   # what setup fills for this model
            else:
                zero.pop(k)                      # no width known: DeepSpeed's default stands in
                notes.append('"auto" ZeRO sizes need the model width: DeepSpeed\'s defaults shown '
                             '(5e8-element buckets; a run sizes them from its model)')
    stage = int(zero.get("stage", 0)) if stage is None else stage
    accum = (data_types or {}).get("grad_accum_dtype")
    # setup (_grad_accum_dtype) fills fp32 accumulation for bf16 from stage 1 when the JSON is silent.
    fp32_accum = (ACCUM_DTYPES.get(str(accum).lower()) == "fp32") if accum else (precision == "bf16" and stage >= 1)
    return ZeroSettings(stage, device("offload_optimizer"), device("offload_param"), zero,
                        grad_accum_fp32=fp32_accum and precision != "fp32"), notes


# Fastest first, with DDP's (ddp.py): more communication than DDP, then PCIe traffic.
registry.register(registry.Backend(
    name="deepspeed", block="zero_optimization", strategy=ZeroStrategy, setup=setup,
    option=_option, default_option=_default_option, describe=describe, cost=cost.zero,
    startup=cost.DEEPSPEED_STARTUP, default=True,
    options=(registry.PlannerOption(1, "ZeRO-1", "zero1.json"), registry.PlannerOption(2, "ZeRO-2", "zero2.json"),
             registry.PlannerOption(3, "ZeRO-3", "zero3.json"),
             registry.PlannerOption(4, "ZeRO-2 + opt offload", "zero2_offload.json"),
             registry.PlannerOption(5, "ZeRO-3 + param/opt offload", "zero3_offload.json"))))
