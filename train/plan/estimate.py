"""The ZeRO planner's arithmetic: the peak memory each option (DDP, ZeRO-0..3, offload) needs
per device, and the fastest option that fits. `zerotrain plan` (flags, table) is
train/commands/plan.py; the check before a run and --ds-config auto, train/plan/memory_check.py.

A rank's peak is

    runtime + model states + buffers + max(activations + backward work, optimizer-step work)

Each term follows what DeepSpeed 0.19 really allocates (read from its source; model states match
train/observe/memory.py's measurement to the byte), not only the ZeRO paper's 16Ψ / 4Ψ+12Ψ/N /
2Ψ+14Ψ/N / 16Ψ/N: the functions of each option below say what they count. On CPU the peak is
what a rank's memory cgroup is charged with compact malloc (train/launch/host_settings.py); on
CUDA, torch.cuda.max_memory_allocated (the allocator's cache comes on top: the headroom).
Measured against runs and against DeepSpeed's own estimators: BENCHMARKS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from train import paths
from train.plan.activations import activation_bytes, sp_exchange_bytes
from train.plan.shapes import BatchShape, ModelShape
from train.plan.strategy import Strategy, default_strategy, strategy_from_json

GiB = 2 ** 30
MiB = 2 ** 20

# Fastest first: same communication as DDP, then more communication, then PCIe traffic.
OPTIONS = (("DDP", "ddp.json"), ("ZeRO-1", "zero1.json"), ("ZeRO-2", "zero2.json"), ("ZeRO-3", "zero3.json"),
           ("ZeRO-2 + opt offload", "zero2_offload.json"), ("ZeRO-3 + param/opt offload", "zero3_offload.json"))

ALLREDUCE_BUCKET = 5e8        # engine.allreduce_gradients' flatten size under ZeRO-0
# DeepSpeed's CPU all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp): a shared-memory workspace of
# 2 x 32 MiB per rank (+ small-message buffers), charged to the rank that creates it.
DS_CPU_COMM_WORKSPACE = 64 * MiB
# What a CPU rank's owned memory grows by while its Accelerator starts, on top of Device.runtime
# (measured before the process group exists): DeepSpeed's communication backend and comm op, or
# DDP's (measured: DEVELOPERS.md).
STARTUP = {"deepspeed": 48 * MiB, "ddp": 4 * MiB}


# ----------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Device:
    """What the planned ranks run on. kind "cuda": bytes allocated on the GPU (the budget is its
    free memory); "cpu": resident bytes of a process whose device is host RAM. runtime: bytes
    the process owns before its process group and Accelerator exist (CPU: the libraries'
    memory, train/launch/device_memory.py; CUDA: 0); on a CPU the estimate adds the option's
    own start-up (STARTUP)."""

    kind: str = "cuda"
    runtime: int = 0


CUDA = Device("cuda", 0)


@dataclass
class Estimate:
    strategy: Strategy
    params: int
    grads: int
    optimizer: int
    activations: Optional[int]  # None: architecture unknown
    buffers: int                # held all along besides the model states
    host: int                   # offloaded bytes per rank (CPU memory)
    comm: Optional[float]       # communication volume per optimizer step, relative to DDP
    pcie: int = 0               # host<->device bytes per step and device (offload)
    backward_work: int = 0      # transient during forward/backward, besides the activations
    step_work: int = 0          # transient during the optimizer step
    runtime: int = 0            # held before the model exists (Device.runtime)
    device_kind: str = "cuda"
    fits: Optional[bool] = None
    notes: list = field(default_factory=list)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def work(self) -> int:
        """The larger of the two phases' transients (activations count in the backward one)."""
        return max((self.activations or 0) + self.backward_work, self.step_work)

    @property
    def device_total(self) -> int:
        """Peak bytes per device. On a CPU the offloaded states live in the same memory."""
        host = self.host if self.device_kind == "cpu" else 0
        return self.runtime + self.model_states + self.buffers + self.work + host

    def to_dict(self) -> dict:
        return {"option": self.strategy.label, "ds_config": self.strategy.path, "stage": self.strategy.stage,
                "precision": self.strategy.precision, "device": self.device_kind,
                "device_bytes": {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                                 "activations": self.activations, "buffers": self.buffers,
                                 "backward_work": self.backward_work, "step_work": self.step_work,
                                 "runtime": self.runtime, "model_states": self.model_states,
                                 "total": self.device_total},
                "host_bytes_per_rank": self.host, "comm_vs_ddp": self.comm, "pcie_bytes_per_step": self.pcie,
                "fits": self.fits, "notes": self.notes}


# ----------------------------------------------------------------------------- the arithmetic

@dataclass(frozen=True)
class _Rank:
    """What every option's arithmetic reads about one rank."""

    shape: ModelShape
    s: Strategy
    n: int              # world size
    device: Device

    @property
    def b(self) -> int:
        """Bytes of a parameter or gradient element in the training dtype."""
        return 4 if self.s.precision == "fp32" else 2

    @property
    def acc(self) -> int:
        """Bytes of an accumulated gradient element."""
        return 4 if self.s.grad_accum_fp32 else self.b

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


def _adam_work(device: Device, largest: int, total: int, fused: bool = False) -> int:
    """torch AdamW's temporaries for one step() over tensors of `total` elements, the largest
    `largest`: on CPU the single-tensor path builds sqrt(v) and its quotient for one tensor at a
    time (2 copies of the largest); on CUDA the foreach path one copy of everything; fused none."""
    if device.kind == "cpu":
        return 8 * largest
    return 0 if fused else 4 * total


def estimate(shape: ModelShape, s: Strategy, world: int, batch: BatchShape, rank: Optional[int] = None,
             device: Device = CUDA) -> Estimate:
    """Peak bytes per device for one rank (`rank`), or the largest over all ranks (None)."""
    r = _Rank(shape, s, world, device)
    notes = list(s.notes) + ([] if shape.gpt is not None else ["activations unknown (parameter count only)"])
    if not shape.shapes_known:
        notes.append("transients of single tensors unknown (parameter count only)")
    if s.backend == "ddp":
        terms = _ddp(r)
    elif s.stage == 0:
        terms = _zero0(r)
    elif s.stage in (1, 2):
        terms = _zero12(r, batch, rank)
    else:
        terms = _zero3(r, batch)
        if not shape.shapes_known:
            notes.append("ZeRO-3 persistence not modelled (parameter count only)")
    return _with_batch(r, batch, terms, notes)


def _with_batch(r: _Rank, batch: BatchShape, terms: dict, notes: list) -> Estimate:
    """The Estimate from an option's terms plus what the micro-batch and the process add:
    activations, sequence parallelism's all-to-all buffers, the runtime (the same whichever path
    asks: the memory check, --ds-config auto, zerotrain plan)."""
    gpt, b = r.shape.gpt, r.b
    exchange = sp_exchange_bytes(gpt, batch, b) if gpt is not None else 0
    terms["backward_work"] = terms.get("backward_work", 0) + exchange
    runtime = r.device.runtime + (STARTUP[r.s.backend] if r.cpu and r.device.runtime else 0)
    e = Estimate(r.s, activations=activation_bytes(gpt, batch, b) if gpt is not None else None, runtime=runtime,
                 device_kind=r.device.kind, notes=notes, **terms)
    for k in ("params", "grads", "optimizer", "buffers", "host", "backward_work", "step_work"):
        setattr(e, k, int(getattr(e, k)))
    return e


def _ddp(r: _Rank) -> dict:
    """Accelerate autocast keeps fp32 params and grads whatever the precision (16Ψ); 16-bit weight
    copies live until backward. gloo all-reduces a bucket through its own send/receive copies
    (two buckets on CPU); zerotrain's DDP AdamW is fused on CUDA."""
    s, psi, n, trained = r.s, r.shape.num_params, r.n, r.trained
    return dict(params=4 * psi, grads=4 * trained * (1 if s.bucket_view else 2), optimizer=8 * trained,
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
        return dict(params=4 * psi, grads=4 * trained, optimizer=8 * trained, buffers=r.comm_workspace, host=0,
                    comm=1.0 if n > 1 else None, backward_work=flatten,
                    step_work=_adam_work(r.device, r.largest, trained))
    return dict(params=b * psi, grads=b * trained, optimizer=12 * trained, buffers=r.comm_workspace, host=0,
                comm=1.0 if n > 1 else None, backward_work=flatten,
                step_work=4 * trained + _adam_work(r.device, r.largest, trained))


def _zero12(r: _Rank, batch: BatchShape, rank: Optional[int]) -> dict:
    """ZeRO-1/2: each flat group padded to 2N elements and split; a rank holds the whole gradient
    of every tensor overlapping its partition (ZeRO-1: all gradients until the accumulation
    boundary). DeepSpeed keeps an fp32 master partition even in fp32 training: optimizer states
    are 12 bytes per owned element. Reduce buckets are doubled by overlap_comm, allocated whole
    on CUDA and resident up to what fills them on CPU."""
    s, b, n, trained, shape = r.s, r.b, r.n, r.trained, r.shape
    ranks = range(n) if rank is None else [rank]
    owned, held = max((_zero12_partition(shape.groups, n, k) for k in ranks), key=lambda oh: oh[1])
    group_part = max(math.ceil(sum(g) / (2 * n)) * 2 for g in shape.groups)  # largest flat partition stepped
    if not shape.shapes_known:
        held = owned
    comm = (1.0 if s.stage == 1 else (batch.accum + 1) / 2) if n > 1 else None
    rbs = s.z("reduce_bucket_size")
    bucket = int(min(rbs, trained) if r.cpu else rbs) * b * (2 if s.overlap_comm else 1)
    if s.stage == 1 and s.precision == "bf16" and s.grad_accum_fp32 and not s.offload_optimizer:
        # DeepSpeed's BF16_Optimizer: bf16 params and their bf16 grads, fp32 gradient accumulators
        # for every parameter (the partition AdamW steps is a view of them).
        return dict(params=2 * shape.num_params, grads=(2 + 4) * trained, optimizer=12 * owned,
                    buffers=r.comm_workspace, host=0, comm=comm, step_work=_adam_work(r.device, group_part, owned))
    if s.offload_optimizer:
        return _zero12_offload(r, batch, owned, held, bucket, comm)
    grads = r.acc * (trained if s.stage == 1 and batch.accum > 1 else held)
    # The step hands AdamW an fp32 copy of the gradient partition.
    return dict(params=b * shape.num_params, grads=grads, optimizer=12 * owned, buffers=bucket + r.comm_workspace,
                host=0, comm=comm, backward_work=b * r.largest,
                step_work=4 * owned + _adam_work(r.device, group_part, owned))


def _zero12_offload(r: _Rank, batch: BatchShape, owned: int, held: int, bucket: int, comm) -> dict:
    """ZeRO-1/2 with the optimizer on the host: fp32 master + fp32 grads + moments + a 16-bit
    staging copy of the partition, a largest-tensor bounce buffer, and (accumulating) per-tensor
    gradient accumulators. DeepSpeedCPUAdam steps in place; around it the host holds an fp32
    gradient partition and a copy of the updated partition in the training dtype."""
    b, largest = r.b, r.largest
    host = (4 + 4 + 8 + b) * owned + b * largest + (b * held if batch.accum > 1 else 0)
    return dict(params=b * r.shape.num_params, grads=0, optimizer=0, buffers=bucket + b * largest + r.comm_workspace,
                host=host, comm=comm, pcie=b * owned * (batch.accum + 1), backward_work=b * largest,
                step_work=(4 + b) * owned if r.cpu else 0)


def _zero3(r: _Rank, batch: BatchShape) -> dict:
    """ZeRO-3: every tensor split into ceil(numel / N) pieces; tensors of at most
    stage3_param_persistence_threshold elements are also kept whole. Backward gathers at most
    stage3_max_live_parameters (a MoE leaf block whole, whatever the limit) and one full
    gradient; the optimizer keeps an fp32 gradient buffer of its largest sub-group. Offload moves
    the optimizer states (with the fp32 gradient partition Adam reads) or the parameters to
    the host."""
    s, b, n, shape = r.s, r.b, r.n, r.shape
    threshold = s.z("stage3_param_persistence_threshold")
    part = sum(math.ceil(t / n) for t in shape.tensors)
    frozen_part = sum(math.ceil(t / n) for t in shape.frozen)
    tensors = list(shape.tensors) + list(shape.frozen)
    persistent = sum(t for t in tensors if t <= threshold)
    partitioned = sum(t for t in tensors if t > threshold)
    group_part = max(sum(math.ceil(t / n) for t in g) for g in shape.groups)
    sub_group = int(min(s.z("sub_group_size"), group_part))          # one optimizer sub-group
    gathered = b * int(max(min(partitioned, s.z("stage3_max_live_parameters")), shape.leaf_block))
    ipg = int(min(s.z("reduce_bucket_size"), r.largest or r.trained) if r.cpu else s.z("reduce_bucket_size")) * b
    params_dev, grads_dev, opt_dev = b * (part + frozen_part) + b * persistent, r.acc * part, 12 * part
    host = pcie = 0
    step_buffer = 4 * sub_group   # stage3.py initialize_optimizer_states: kept between steps
    step_work = 4 * sub_group + _adam_work(r.device, sub_group, sub_group)
    if s.offload_optimizer:
        host += grads_dev + opt_dev + 4 * part
        grads_dev = opt_dev = step_buffer = step_work = 0
        pcie += b * part * (batch.accum + 1)
    if s.offload_param:
        host += b * (part + frozen_part)
        params_dev -= b * (part + frozen_part)
        pcie += 2 * b * part * batch.accum
    return dict(params=params_dev, grads=grads_dev, optimizer=opt_dev, buffers=step_buffer + ipg + r.comm_workspace,
                host=host, comm=1.5 * batch.accum if n > 1 else None, pcie=pcie,
                backward_work=gathered + b * r.largest, step_work=step_work)


# ----------------------------------------------------------------------------- the plan

@dataclass
class Cluster:
    nodes: int
    devices_per_node: int
    device_mem: int
    cpu_mem: Optional[int]       # per node; None = not checked

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass
class Plan:
    shape: ModelShape
    cluster: Cluster
    batch: BatchShape
    safety: float
    rows: list
    recommended: Optional[Estimate]
    device: Device = CUDA
    sp_fit: object = None   # nothing recommended: the sequence parallelism that would fit (train/plan/sp_fit.SPFit)

    def to_dict(self) -> dict:
        return {"model": self.shape.name, "num_params": self.shape.num_params,
                "trained_params": sum(self.shape.tensors), "cluster": vars(self.cluster), "world": self.cluster.world, "batch": vars(self.batch),
                "device": vars(self.device), "safety": self.safety, "options": [r.to_dict() for r in self.rows],
                "recommended": self.recommended.strategy.label if self.recommended else None,
                "recommended_ds_config": self.recommended.strategy.path if self.recommended else None,
                "sequence_parallel_would_fit": self.sp_fit.record() if self.sp_fit else None}


def make_plan(shape: ModelShape, cluster: Cluster, batch: BatchShape, precision: str = "bf16", safety: float = 0.1,
              configs_dir: Path = paths.DS_CONFIGS, device: Device = CUDA) -> Plan:
    """Every option of OPTIONS (the JSONs in `configs_dir`) for this model and cluster. An
    option `fits` when its predicted peak is at most the device memory; the recommendation is
    the fastest one that also leaves `safety` of it free (estimation error, allocator cache), a
    ZeRO one under sequence parallelism (a run refuses SP under plain DDP)."""
    rows = []
    for label, fname in OPTIONS:
        path = Path(configs_dir) / fname
        s = (strategy_from_json(label, path, precision, shape.width) if path.is_file()
             else default_strategy(label, fname, precision))
        rows.append(judge(estimate(shape, s, cluster.world, batch, device=device), cluster, safety))
    best = next((r for r in rows if r.fits and r.device_total <= (1 - safety) * cluster.device_mem
                 and not (r.strategy.backend == "ddp" and batch.sequence_parallel > 1)), None)
    return Plan(shape, cluster, batch, safety, rows, best, device)


def judge(e: Estimate, cluster: Cluster, safety: float) -> Estimate:
    """Set e.fits (peak within the device memory, offloaded states within the host's) and say
    when it fits without the headroom."""
    device_ok = e.device_total <= cluster.device_mem
    host_ok = (cluster.cpu_mem is None or e.device_kind == "cpu"
               or e.host * cluster.devices_per_node <= (1 - safety) * cluster.cpu_mem)
    e.fits = device_ok and host_ok
    if device_ok and not host_ok:
        e.notes.append("offloaded states exceed the CPU memory")
    return e
