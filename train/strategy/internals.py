"""Every private DeepSpeed attribute zerotrain reads, in one place: when a DeepSpeed upgrade
moves one, this module (and tests/test_deepspeed_internals.py, which builds a real engine per
stage and checks each accessor) is where it shows.

Each accessor is a small named function over the object DeepSpeed gives us (the engine, its ZeRO
optimizer, a parameter). A *strict* accessor reads an attribute the running class must have and
raises DeepSpeedInternalsError, one line naming the attribute, the class and the installed
DeepSpeed version, when it is gone. A *probe* (`has_*`, the memory probe's lists) asks what this
class keeps and answers False / None for what it lacks: the classes differ by stage and precision.

Only train/strategy/ reads it (tests/test_structure.py's import rule: nothing else on the
training path imports it, nor DeepSpeed); it imports nothing from zerotrain.
"""

from __future__ import annotations

import functools

WHERE = "train/strategy/internals.py"


class DeepSpeedInternalsError(RuntimeError):
    """A DeepSpeed attribute zerotrain reads is not where this module expects it (an upgrade, a
    defect to fix here: not a user error, so it keeps its traceback)."""


@functools.lru_cache(maxsize=1)
def deepspeed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "(not installed)"


def missing(obj, *names: str) -> DeepSpeedInternalsError:
    """The one-line error for `obj` lacking every one of `names`."""
    return DeepSpeedInternalsError(f"DeepSpeed {deepspeed_version()}: {type(obj).__name__} has no attribute "
                                   f"{' or '.join(names)} ({WHERE})")


def _get(obj, name: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise missing(obj, name) from None


def _first(obj, *names: str):
    """The first of `names` that `obj` has with a value (DeepSpeed renamed some between
    classes or versions); the last one is required."""
    for n in names[:-1]:
        v = getattr(obj, n, None)
        if v:
            return v
    if not hasattr(obj, names[-1]):
        raise missing(obj, *names)
    return getattr(obj, names[-1])


def _call(obj, name: str, *args):
    return _get(obj, name)(*args)


# ---------------------------------------------------------------------------- communication

def shm_comm_in_use() -> bool:
    """Has DeepSpeed's CPU shared-memory all-reduce been set up in this process (its comm
    backend's `shm_comm_op`, deepspeed/comm/torch.py)? A probe: False where DeepSpeed's comm was
    never imported or initialised."""
    import sys
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    return ds_comm is not None and getattr(ds_comm.cdb, "shm_comm_op", None) is not None


# ---------------------------------------------------------------------------- the engine

# DeepSpeedEngine's step counters a checkpoint keeps (engine.global_steps, ...).
COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def engine_counters(engine) -> dict:
    """{counter: int} of COUNTERS."""
    return {k: int(_get(engine, k)) for k in COUNTERS}


def set_engine_counters(engine, global_steps: int, global_samples: int, skipped_steps: int,
                        micro_steps: int) -> None:
    """Sets the counters, and micro_steps (the engine's accumulation boundary counts from it)."""
    for k in (*COUNTERS, "micro_steps"):
        _get(engine, k)  # the attribute must exist: setting a new one would change nothing
    engine.global_steps, engine.global_samples = global_steps, global_samples
    engine.skipped_steps, engine.micro_steps = skipped_steps, micro_steps


def skipped_steps(engine) -> int:
    return int(_get(engine, "skipped_steps"))


# ---------------------------------------------------------------------------- fp16 loss scale

# The scaler fields a checkpoint keeps: ZeRO-1/2/3 (DeepSpeedZeroOptimizer*) keep them in
# .loss_scaler (DynamicLossScaler: cur_scale, cur_iter, last_overflow_iter, cur_hysteresis),
# ZeRO-0 (FP16_Optimizer / FP16_UnfusedOptimizer) in .loss_scale_config (no hysteresis).
SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def loss_scale(optimizer) -> float:
    """The scale now (a property or a method, by class), as a Python float: no host read."""
    value = _get(optimizer, "loss_scale")
    return float(value() if callable(value) else value)


def loss_scaler(optimizer):
    """The object that keeps a DeepSpeed fp16 optimizer's scaler state."""
    for name in ("loss_scaler", "loss_scale_config"):
        h = getattr(optimizer, name, None)
        if h is not None and hasattr(h, "cur_scale"):
            return h
    raise missing(optimizer, "loss_scaler.cur_scale", "loss_scale_config.cur_scale")


def scaler_fields(scaler) -> dict:
    """{field: float} of the SCALER_FIELDS this scaler has (ZeRO-0's has no cur_hysteresis)."""
    return {k: float(getattr(scaler, k)) for k in SCALER_FIELDS if getattr(scaler, k, None) is not None}


def set_scaler_fields(scaler, saved: dict) -> None:
    for k, v in saved.items():
        if k in SCALER_FIELDS and hasattr(scaler, k):
            setattr(scaler, k, float(v) if k == "cur_scale" else int(v))


# ---------------------------------------------------------------------------- ZeRO-0 (bf16/fp16)

def has_master_copies(opt) -> bool:
    """FP16_[Unfused]Optimizer: full fp32 copies of each parameter group."""
    return hasattr(opt, "fp16_groups") and (hasattr(opt, "fp32_groups_flat") or hasattr(opt, "fp32_groups"))


def lp_groups(opt) -> list:
    """The low-precision parameters, per group (FP16_Optimizer, ZeRO-3)."""
    return _get(opt, "fp16_groups")


def master_copies(opt) -> tuple[list | None, list | None]:
    """(one flat fp32 tensor per group (FP16_Optimizer) or None, one fp32 tensor per parameter
    per group (FP16_UnfusedOptimizer) or None)."""
    flats = getattr(opt, "fp32_groups_flat", None)
    if flats:
        return flats, None
    return None, _get(opt, "fp32_groups")


# ---------------------------------------------------------------------------- ZeRO-1/2 (and BF16_Optimizer)

def has_fp32_partitions(opt) -> bool:
    return hasattr(opt, "single_partition_of_fp32_groups") or hasattr(opt, "fp32_groups_flat_partition")


def bit16_groups(opt) -> list:
    """The 16-bit (or fp32 under fp32) parameters, per group."""
    return _first(opt, "bit16_groups", "bf16_groups")


def fp32_partitions(opt) -> list:
    """This rank's flat fp32 partition of each group, the tensors the optimizer steps."""
    return _first(opt, "single_partition_of_fp32_groups", "fp32_groups_flat_partition")


def hp_mapping(param):
    """The parameter's fragment mapping (deepspeed/utils/tensor_fragment.py): which part of it this
    rank's fp32 partition holds; None when it holds none."""
    return _get(param, "_hp_mapping")


def lp_fragment_range(mapping) -> tuple[int, int]:
    """[start, stop) of the flattened parameter a fragment mapping covers."""
    addr = _get(mapping, "lp_fragment_address")
    return addr.start, addr.start + addr.numel


def hp_fragment(mapping):
    """The fp32 master values of the fragment (a view into the partition)."""
    return _get(mapping, "hp_fragment")


def hp_fragment_range(mapping) -> tuple[int, int]:
    """(start, numel) of the fragment inside the flat fp32 partition."""
    addr = _call(mapping, "get_hp_fragment_address")
    return addr.start, addr.numel


def update_lp_params(opt) -> None:
    """Cast this rank's fp32 partitions into the 16-bit weights, then all-gather them."""
    _call(opt, "update_lp_params")


# ---------------------------------------------------------------------------- ZeRO-3

def is_zero3_param(p) -> bool:
    """A parameter DeepSpeed's ZeRO-3 manages (built under zero.Init or converted by the engine)."""
    return hasattr(p, "ds_id")


def has_local_partition(p) -> bool:
    """A ZeRO-3 parameter with its partition made (`ds_tensor`)."""
    return hasattr(p, "ds_tensor")


def is_persistent(p) -> bool:
    """A ZeRO-3 parameter every rank keeps whole (under the persistence threshold)."""
    return bool(getattr(p, "ds_persist", False))


def full_numel(p) -> int:
    """The whole parameter's size (under ZeRO-3 the local tensor is a shard or empty)."""
    return int(_get(p, "ds_numel")) if is_zero3_param(p) else p.numel()


def full_shape(p) -> tuple:
    return tuple(_get(p, "ds_shape")) if is_zero3_param(p) else tuple(p.shape)


def local_partition(p):
    """This rank's flat partition of a ZeRO-3 parameter (`ds_tensor`)."""
    return _get(p, "ds_tensor")


def partition_numel(p) -> int:
    """Elements of one rank's partition (ceil(numel / world), the last padded)."""
    return int(_call(p, "partition_numel"))


def sub_group(opt, p) -> int:
    """The optimizer sub-group (an index into fp32_partitioned_groups_flat) that steps `p`."""
    return _get(opt, "grad_position")[_call(opt, "get_param_id", p)][0]


def partition_rank(opt, p) -> int:
    """The rank whose partition of `p` this rank's optimizer state covers."""
    return _call(opt, "_get_param_partition_rank", p)


def fp32_sub_groups(opt) -> list:
    """This rank's flat fp32 partition of each sub-group, the tensors the optimizer steps."""
    return _get(opt, "fp32_partitioned_groups_flat")


def lp_sub_groups(opt) -> list:
    """This rank's flat 16-bit partition of each sub-group."""
    return _get(opt, "fp16_partitioned_groups_flat")


def partition_all(opt) -> None:
    """Every parameter partitioned, as DeepSpeed's own checkpoint load starts."""
    _call(opt, "checkpoint_event_prologue")


def refresh_lp_partitions(opt) -> None:
    """fp32 partitions -> 16-bit partitions (what a step does), then re-gather the persistent
    parameters, as DeepSpeed's own checkpoint load ends."""
    for i in range(len(lp_sub_groups(opt))):
        _call(opt, "_reassign_or_swap_out_partitioned_parameters", i)
    _call(opt, "checkpoint_event_epilogue")


# ---------------------------------------------------------------------------- the memory probe

# What the ZeRO optimizer classes keep, by role (train/strategy/state_bytes.py's measure()); a class
# keeps some of them, so these are probes: a missing one is None, not an error.
PARAM_FLATS = ("bit16_groups_flat", "fp16_groups_flat")
LP_PARTITIONS = "fp16_partitioned_groups_flat"
GRAD_STORES = ("averaged_gradients", "grads_in_partition", "all_grad_tensors",
               "fp32_groups_gradients_flat")  # the last: BF16_Optimizer's fp32 accumulators
GRAD_PARTITION_BUFFER = "grad_partitions_flat_buffer"
MASTER_FLATS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat")
CPU_GRADS = "accumulated_grads_in_cpu"
# Attributes of the ZeRO optimizer that are not its buffers (the torch optimizer, the model).
NOT_BUFFERS = ("optimizer", "module", "param_names")


def zero_optimizer(engine):
    """The DeepSpeed engine's ZeRO optimizer; None for anything that is not a DeepSpeed engine."""
    return getattr(engine, "optimizer", None) if hasattr(engine, "zero_optimization_stage") else None


def probe(zero, name: str):
    """`zero.<name>` if this optimizer class keeps it, else None."""
    return getattr(zero, name, None)


def offloads(zero) -> tuple[bool, bool]:
    """(optimizer offloaded, parameters offloaded) as the ZeRO optimizer placed them."""
    return (bool(getattr(zero, "cpu_offload", False) or getattr(zero, "offload_optimizer", False)),
            bool(getattr(zero, "offload_param", False)))


def grad_accumulator(p):
    """A parameter's DeepSpeed gradient accumulator (`grad_accum`), if any."""
    return getattr(p, "grad_accum", None)


def drop_partition_gradients(optimizer) -> None:
    """A planted bug for tests (train/testhooks.py "plant_drop_partition"): the ZeRO-1/2
    optimizer's step first zeroes this rank's partition of the reduced gradient
    (averaged_gradients), so both the global norm and this rank's update lose it."""
    step = optimizer.step
    _get(optimizer, "averaged_gradients")  # fails now, in one line, on a class without it

    def dropped(*args, **kwargs):
        for group in optimizer.averaged_gradients.values():
            for g in group or ():
                g.zero_()
        return step(*args, **kwargs)
    optimizer.step = dropped
