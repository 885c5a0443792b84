"""The planner's cost model of each backend: the bytes a rank of plain DDP, ZeRO-0, ZeRO-1/2
(with optimizer offload) or ZeRO-3 (with optimizer / parameter offload) holds, term by term.
train/plan/estimate.py adds what does not depend on the backend (the micro-batch's activations,
sequence parallelism's buffers, the process's runtime) and compares options.

Each term follows what DeepSpeed 0.19 really allocates (read from its source; model states match
train/observe/memory.py's measurement to the byte), not only the ZeRO paper's 16Ψ / 4Ψ+12Ψ/N /
2Ψ+14Ψ/N / 16Ψ/N: the function of each backend below says what it counts. `shape` is the
planner's ModelShape (train/plan/shapes.py), `batch` its BatchShape and `device` its Device
(train/plan/estimate.py), read by attribute: this package sits below the planner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from zerotrain.train.strategy.option import Option

MiB = 2 ** 20

ALLREDUCE_BUCKET = 5e8        # engine.allreduce_gradients' flatten size under ZeRO-0
# DeepSpeed's CPU all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp): a shared-memory workspace of
# 2 x 32 MiB per rank (+ small-message buffers), charged to the rank that creates it.
DS_CPU_COMM_WORKSPACE = 64 * MiB
# What a CPU rank's owned memory grows by while its Accelerator starts, on top of Device.runtime
# (measured before the process group exists), each backend's `startup` in its registry entry:
# DeepSpeed's communication backend and comm op, or DDP's (measured: docs/machine_notes.md
# "DeepSpeed and Accelerate on CPU").
DEEPSPEED_STARTUP = 48 * MiB
DDP_STARTUP = 4 * MiB


def terms(shape, s: Option, world: int, batch, device, rank: Optional[int] = None) -> tuple[dict, list]:
    """(the option's terms for one rank (`rank`) or the largest over all ranks (None): params,
    grads, optimizer, buffers, host, comm, pcie, backward_work and step_work in bytes, what
    train/plan/estimate.Estimate holds, and `master`: the fp32 master elements the rank holds (the
    ones its moments cover; on the host where `master_on_host`); the caveats of the arithmetic
    for this model). The option's backend (train/strategy/registry.py) has the arithmetic."""
    import zerotrain.train.strategy.registry as registry
    return registry.get(s.backend).cost(_Rank(shape, s, world, device), batch, rank)


def startup(s: Option) -> int:
    """What a CPU rank's memory grows by while the option's Accelerator starts (its backend's)."""
    import zerotrain.train.strategy.registry as registry
    return registry.get(s.backend).startup


def ddp(r, batch, rank: Optional[int] = None) -> tuple[dict, list]:
    """Plain DDP's terms and caveats (its registry entry's cost)."""
    return _ddp(r), []


def zero(r, batch, rank: Optional[int] = None) -> tuple[dict, list]:
    """DeepSpeed ZeRO's terms and caveats, by stage (its registry entry's cost)."""
    stage = r.s.settings.stage
    if stage == 0:
        return _zero0(r), []
    if stage in (1, 2):
        return _zero12(r, batch, rank), []
    return _zero3(r, batch), ([] if r.shape.shapes_known else ["ZeRO-3 persistence not modelled (parameter count only)"])


@dataclass(frozen=True)
class _Rank:
    """What every option's arithmetic reads about one rank."""

    shape: object       # train/plan/shapes.py ModelShape
    s: Option
    n: int              # world size
    device: object      # train/plan/estimate.py Device

    @property
    def b(self) -> int:
        """Bytes of a parameter or gradient element in the training dtype."""
        return self.s.elem_bytes

    @property
    def trained(self) -> int:
        return sum(self.shape.tensors)

    @property
    def largest(self) -> int:
        """The largest trainable tensor; without real shapes 0 (no straddling tensors, no
        single tensor larger than a bucket)."""
        return max(self.shape.tensors) if self.shape.shapes_known else 0

    @property
    def cpu(self) -> bool:
        return self.device.kind == "cpu"

    @property
    def comm_workspace(self) -> int:
        return DS_CPU_COMM_WORKSPACE if self.cpu and self.n > 1 else 0


def _accumulated(r: _Rank) -> int:
    """Bytes of a ZeRO accumulated gradient element: fp32 where the option accumulates in fp32."""
    return 4 if r.s.settings.grad_accum_fp32 else r.b


def _zero12_partition(groups, world: int, rank: int) -> tuple[int, int]:
    """(elements this rank owns, gradient elements it holds) under ZeRO-1/2: each group is
    flattened, padded to 2*world and split evenly; gradients are kept per whole tensor for
    every tensor that overlaps the rank's slice."""
    owned = held = 0
    for g in groups:
        padded = math.ceil(sum(g) / (2 * world)) * 2 * world
        part = padded // world
        lo, hi = rank * part, (rank + 1) * part
        owned += part
        offset = 0
        for n in g:
            if offset < hi and offset + n > lo:
                held += n
            offset += n
    return owned, held


def _adam_work(device, largest: int, total: int, fused: bool = False) -> int:
    """torch AdamW's temporaries for one step() over tensors of `total` elements, the largest
    `largest`: on CPU the single-tensor path builds sqrt(v) and its quotient for one tensor at a
    time (2 copies of the largest); on CUDA the foreach path one copy of everything; fused none."""
    if device.kind == "cpu":
        return 8 * largest
    return 0 if fused else 4 * total


def _ddp(r: _Rank) -> dict:
    """Accelerate autocast keeps fp32 params and grads whatever the precision (16Ψ); 16-bit weight
    copies live until backward. gloo all-reduces a bucket through its own send/receive copies
    (two buckets on CPU); zerotrain's DDP AdamW is fused on CUDA."""
    s, psi, n, trained = r.s.settings, r.shape.num_params, r.n, r.trained
    return dict(params=4 * psi, grads=4 * trained * (1 if s.bucket_view else 2), optimizer=8 * trained, master=trained,
                buffers=2 * s.bucket_cap_mb * MiB if r.cpu and n > 1 else 0, host=0,
                comm=1.0 if n > 1 else None, backward_work=2 * psi if r.b == 2 else 0,
                step_work=_adam_work(r.device, r.largest, trained, fused=True))


def _zero0(r: _Rank) -> dict:
    """ZeRO-0: the engine flattens gradients for its all-reduce (backward work). In fp32 the torch
    optimizer steps the fp32 params directly; in 16 bits FP16_UnfusedOptimizer keeps 16-bit
    params and grads with fp32 master copies, and makes fp32 gradients at the step."""
    b, psi, n, trained = r.b, r.shape.num_params, r.n, r.trained
    flatten = b * min(trained, ALLREDUCE_BUCKET) if n > 1 else 0
    if b == 4:
        return dict(params=4 * psi, grads=4 * trained, optimizer=8 * trained, master=trained, buffers=r.comm_workspace, host=0,
                    comm=1.0 if n > 1 else None, backward_work=flatten,
                    step_work=_adam_work(r.device, r.largest, trained))
    return dict(params=b * psi, grads=b * trained, optimizer=12 * trained, master=trained, buffers=r.comm_workspace, host=0,
                comm=1.0 if n > 1 else None, backward_work=flatten,
                step_work=4 * trained + _adam_work(r.device, r.largest, trained))


def _zero12(r: _Rank, batch, rank: Optional[int]) -> dict:
    """ZeRO-1/2: each flat group padded to 2N elements and split; a rank holds the whole gradient
    of every tensor overlapping its partition (ZeRO-1: all gradients until the accumulation
    boundary). DeepSpeed keeps an fp32 master partition even in fp32 training: optimizer states
    are 12 bytes per owned element. Reduce buckets are doubled by overlap_comm, allocated whole
    on CUDA and resident up to what fills them on CPU."""
    s, b, n, trained, shape = r.s.settings, r.b, r.n, r.trained, r.shape
    ranks = range(n) if rank is None else [rank]
    owned, held = max((_zero12_partition(shape.groups, n, k) for k in ranks), key=lambda oh: oh[1])
    group_part = max(math.ceil(sum(g) / (2 * n)) * 2 for g in shape.groups)  # largest flat partition stepped
    if not shape.shapes_known:
        held = owned
    comm = (1.0 if s.stage == 1 else (batch.accum + 1) / 2) if n > 1 else None
    rbs = s.size("reduce_bucket_size")
    bucket = int(min(rbs, trained) if r.cpu else rbs) * b * (2 if s.overlap_comm else 1)
    if s.stage == 1 and r.s.precision == "bf16" and s.grad_accum_fp32 and s.offload_optimizer is None:
        # DeepSpeed's BF16_Optimizer: bf16 params and their bf16 grads, fp32 gradient accumulators
        # for every parameter (the partition AdamW steps is a view of them).
        return dict(params=2 * shape.num_params, grads=(2 + 4) * trained, optimizer=12 * owned, master=owned,
                    buffers=r.comm_workspace, host=0, comm=comm, step_work=_adam_work(r.device, group_part, owned))
    if s.offload_optimizer is not None:
        return _zero12_offload(r, batch, owned, held, bucket, comm)
    grads = _accumulated(r) * (trained if s.stage == 1 and batch.accum > 1 else held)
    # The step hands AdamW an fp32 copy of the gradient partition.
    return dict(params=b * shape.num_params, grads=grads, optimizer=12 * owned, master=owned, buffers=bucket + r.comm_workspace,
                host=0, comm=comm, backward_work=b * r.largest,
                step_work=4 * owned + _adam_work(r.device, group_part, owned))


def _zero12_offload(r: _Rank, batch, owned: int, held: int, bucket: int, comm) -> dict:
    """ZeRO-1/2 with the optimizer on the host: fp32 master + fp32 grads + moments + a 16-bit
    staging copy of the partition, a largest-tensor bounce buffer, and (accumulating) per-tensor
    gradient accumulators. DeepSpeedCPUAdam steps in place; around it the host holds an fp32
    gradient partition and a copy of the updated partition in the training dtype."""
    b, largest = r.b, r.largest
    host = (4 + 4 + 8 + b) * owned + b * largest + (b * held if batch.accum > 1 else 0)
    return dict(params=b * r.shape.num_params, grads=0, optimizer=0, master=owned, master_on_host=True,
                buffers=bucket + b * largest + r.comm_workspace,
                host=host, comm=comm, pcie=b * owned * (batch.accum + 1), backward_work=b * largest,
                step_work=(4 + b) * owned if r.cpu else 0)


def _zero3(r: _Rank, batch) -> dict:
    """ZeRO-3: every tensor split into ceil(numel / N) pieces; tensors of at most
    stage3_param_persistence_threshold elements are also kept whole. Backward gathers at most
    stage3_max_live_parameters (a MoE leaf block whole, whatever the limit) and one full
    gradient; the optimizer keeps an fp32 gradient buffer of its largest sub-group. Offload moves
    the optimizer states (with the fp32 gradient partition Adam reads) or the parameters to
    the host."""
    s, b, n, shape = r.s.settings, r.b, r.n, r.shape
    threshold = s.size("stage3_param_persistence_threshold")
    part = sum(math.ceil(t / n) for t in shape.tensors)
    frozen_part = sum(math.ceil(t / n) for t in shape.frozen)
    tensors = list(shape.tensors) + list(shape.frozen)
    persistent = sum(t for t in tensors if t <= threshold)
    partitioned = sum(t for t in tensors if t > threshold)
    group_part = max(sum(math.ceil(t / n) for t in g) for g in shape.groups)
    sub_group = int(min(s.size("sub_group_size"), group_part))          # one optimizer sub-group
    gathered = b * int(max(min(partitioned, s.size("stage3_max_live_parameters")), shape.leaf_block))
    ipg = int(min(s.size("reduce_bucket_size"), r.largest or r.trained) if r.cpu else s.size("reduce_bucket_size")) * b
    params_dev, grads_dev, opt_dev = b * (part + frozen_part) + b * persistent, _accumulated(r) * part, 12 * part
    host = pcie = 0
    step_buffer = 4 * sub_group   # stage3.py initialize_optimizer_states: kept between steps
    step_work = 4 * sub_group + _adam_work(r.device, sub_group, sub_group)
    if s.offload_optimizer is not None:
        host += grads_dev + opt_dev + 4 * part
        grads_dev = opt_dev = step_buffer = step_work = 0
        pcie += b * part * (batch.accum + 1)
    if s.offload_param is not None:
        host += b * (part + frozen_part)
        params_dev -= b * (part + frozen_part)
        pcie += 2 * b * part * batch.accum
    return dict(params=params_dev, grads=grads_dev, optimizer=opt_dev, master=part,
                master_on_host=s.offload_optimizer is not None,
                buffers=step_buffer + ipg + r.comm_workspace,
                host=host, comm=1.5 * batch.accum if n > 1 else None, pcie=pcie,
                backward_work=gathered + b * r.largest, step_work=step_work)
