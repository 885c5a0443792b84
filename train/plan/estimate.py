"""The ZeRO planner's arithmetic: the peak memory each option (DDP, ZeRO-0..3, offload) needs
per device, and the fastest option that fits. `zerotrain plan` (flags, table) is
train/commands/plan.py; the check before a run and --ds-config auto, train/plan/memory_check.py.

A rank's peak is

    runtime + model states + buffers + max(activations + backward work, optimizer-step work)
            [+ the checkpoint.async host snapshot, on a CPU]

With checkpoint.async each rank keeps a host copy of its share of the checkpoint between saves
(`snapshot_bytes`): on a CPU that is the device's memory, so it counts in the peak; on CUDA it is
host RAM (pinned), not part of the GPU's peak: reported (Estimate.snapshot) and compared with the
free host RAM by memory_plan.make instead.

What each backend holds (model states, buffers, its own transients, offloaded bytes) is the
strategy package's cost model, train/strategy/cost.py; this module adds what the micro-batch and
the process add (activations, sequence parallelism's buffers, the runtime) and compares options.
On CPU the peak is what a rank's memory cgroup is charged with compact malloc
(train/launch/host_settings.py); on CUDA, torch.cuda.max_memory_allocated (the allocator's cache
comes on top: the headroom). Measured against runs and against DeepSpeed's own estimators:
BENCHMARKS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import zerotrain.train.strategy.registry as registry
from zerotrain.train import paths
from zerotrain.train.plan.activations import activation_bytes, sp_exchange_bytes
from zerotrain.train.plan.shapes import BatchShape, ModelShape
from zerotrain.train.strategy import cost
from zerotrain.train.strategy.option import Option

GiB = 2 ** 30
MiB = 2 ** 20

# (label, shipped file) of every registered backend's options, fastest first: same communication
# as DDP, then more communication, then PCIe traffic (train/strategy/registry.py).
OPTIONS = tuple((o.label, o.file) for o in registry.planner_options())


# ----------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Device:
    """What the planned ranks run on. kind "cuda": bytes allocated on the GPU (the budget is its
    free memory); "cpu": resident bytes of a process whose device is host RAM. runtime: bytes
    the process owns before its process group and Accelerator exist (CPU: the libraries'
    memory, train/launch/device_memory.py; CUDA: 0); on a CPU the estimate adds the option's
    own start-up (train/strategy/cost.py startup)."""

    kind: str = "cuda"
    runtime: int = 0


CUDA = Device("cuda", 0)


@dataclass
class Estimate:
    option: Option
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
    snapshot: int = 0           # checkpoint.async: the host snapshot of this rank's checkpoint share
    master: int = 0             # fp32 master elements this rank holds (what its moments cover)
    master_on_host: bool = False  # ... on the host (optimizer offload)
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
        """Peak bytes per device. On a CPU the offloaded states and the checkpoint.async
        snapshot live in the same memory."""
        host = self.host + self.snapshot if self.device_kind == "cpu" else 0
        return self.runtime + self.model_states + self.buffers + self.work + host

    def to_dict(self) -> dict:
        return {"option": self.option.label, "ds_config": self.option.path, "stage": self.option.stage,
                "precision": self.option.precision, "device": self.device_kind,
                "device_bytes": {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                                 "activations": self.activations, "buffers": self.buffers,
                                 "backward_work": self.backward_work, "step_work": self.step_work,
                                 "runtime": self.runtime, "model_states": self.model_states,
                                 "total": self.device_total},
                "host_bytes_per_rank": self.host, "checkpoint_snapshot_bytes": self.snapshot, "comm_vs_ddp": self.comm, "pcie_bytes_per_step": self.pcie,
                "fits": self.fits, "notes": self.notes}


# ----------------------------------------------------------------------------- the arithmetic

def snapshot_bytes(shape: ModelShape, world: int, frozen_saved: bool = True) -> int:
    """checkpoint.async's host snapshot on the largest rank: what its checkpoint files hold, the fp32
    master value and the two AdamW moments of its share of every trained tensor (each rank saves
    ~1/world of each: train/strategy/holders.py slot.save), and the fp32 value of its share of the
    frozen ones unless the run is LoRA's (its checkpoints hold the adapters only: `frozen_saved`
    False). The persistent buffers rank 0 also copies are left out (the GPT has none)."""
    share = lambda ts: sum(math.ceil(t / world) for t in ts)  # noqa: E731
    return 12 * share(shape.tensors) + (4 * share(shape.frozen) if frozen_saved else 0)


def estimate(shape: ModelShape, s: Option, world: int, batch: BatchShape, rank: Optional[int] = None,
             device: Device = CUDA, snapshot: int = 0) -> Estimate:
    """Peak bytes per device for one rank (`rank`), or the largest over all ranks (None).
    `snapshot`: checkpoint.async's host snapshot per rank (`snapshot_bytes`; 0 = saves are synchronous)."""
    notes = list(s.notes) + ([] if shape.gpt is not None else ["activations unknown (parameter count only)"])
    if not shape.shapes_known:
        notes.append("transients of single tensors unknown (parameter count only)")
    terms, caveats = cost.terms(shape, s, world, batch, device, rank)
    e = _with_batch(shape, s, device, batch, terms, notes + caveats)
    e.snapshot = int(snapshot)
    return e


def _with_batch(shape: ModelShape, s: Option, device: Device, batch: BatchShape, terms: dict,
                notes: list) -> Estimate:
    """The Estimate from an option's terms plus what the micro-batch and the process add:
    activations, sequence parallelism's all-to-all buffers, the runtime (the same whichever path
    asks: the memory check, --ds-config auto, zerotrain plan)."""
    gpt, b = shape.gpt, s.elem_bytes
    exchange = sp_exchange_bytes(gpt, batch, b) if gpt is not None else 0
    terms["backward_work"] = terms.get("backward_work", 0) + exchange
    if batch.reference_copy:  # DPO's live reference of full fine-tuning: every parameter once more, fp32
        terms["buffers"] = terms.get("buffers", 0) + 4 * shape.num_params
        notes = notes + ["frozen fp32 reference copy in buffers"]
    if batch.ema_copy:  # train.ema: the average of the master elements the rank holds, where they live
        where = "host" if terms.get("master_on_host") else "buffers"
        terms[where] = terms.get(where, 0) + 4 * terms.get("master", 0)
        notes = notes + [f"train.ema's fp32 average in {where}"]
    runtime = device.runtime + (cost.startup(s) if device.kind == "cpu" and device.runtime else 0)
    e = Estimate(s, activations=activation_bytes(gpt, batch, b) if gpt is not None else None, runtime=runtime,
                 device_kind=device.kind, notes=notes, **terms)
    for k in ("params", "grads", "optimizer", "buffers", "host", "backward_work", "step_work"):
        setattr(e, k, int(getattr(e, k)))
    return e


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
                "recommended": self.recommended.option.label if self.recommended else None,
                "recommended_ds_config": self.recommended.option.path if self.recommended else None,
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
        s = (Option.from_json(label, path, precision, shape.width) if path.is_file()
             else Option.default(label, fname, precision))
        rows.append(judge(estimate(shape, s, cluster.world, batch, device=device), cluster, safety))
    best = next((r for r in rows if r.fits and r.device_total <= (1 - safety) * cluster.device_mem
                 and (batch.sequence_parallel <= 1 or r.option.splits_sequences)), None)
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
