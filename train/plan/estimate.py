"""The ZeRO planner's arithmetic: the peak memory each ZeRO option needs per device, and the
fastest option that fits. The `zerotrain plan` command (flags, table) is train/commands/plan.py.

    zerotrain plan gpt-1.3b --gpus-per-node 8 --device-mem 80GB --micro-batch 8
    zerotrain plan runs/my_run.yaml --device-mem 24GiB --json
    zerotrain plan run.yaml --device cpu --device-mem 3.5GiB --gpus-per-node 2   # CPU ranks, RAM cap

A rank's peak is

    runtime + model states + buffers + max(activations + backward work, optimizer-step work)

* runtime: what the process holds before the model exists. On CUDA the device's free memory is
  read after the context exists, so 0; on a CPU (the device is host RAM) the memory a rank owns
  once torch, DeepSpeed, Accelerate, transformers and torch._dynamo are imported (~0.36-0.45 GiB
  of anonymous pages; their shared library code, ~0.5 GiB, is charged to no rank), measured
  before the process group exists, plus what starting the option's Accelerator adds (STARTUP:
  DeepSpeed's communication backend ~42 MiB, DDP ~3 MiB).
* model states (params, grads, optimizer) follow what DeepSpeed 0.19 really allocates (read from
  its source, checked to the byte against train/observe/memory.py's measurement), not only the ZeRO
  paper's 16Ψ / 4Ψ+12Ψ/N / 2Ψ+14Ψ/N / 16Ψ/N for mixed-precision Adam:
  - params / grads use the training dtype (2 bytes for bf16/fp16, 4 for fp32); under bf16 ZeRO-1/2/3
    gradients accumulate in fp32 (data_types.grad_accum_dtype, train/dsconfig.py). DeepSpeed keeps
    a separate fp32 master partition even in fp32 training: optimizer states are 12 bytes per
    owned element.
  - DDP (Accelerate autocast) keeps fp32 params and grads whatever the precision: 16Ψ.
  - ZeRO-1/2 flat groups are padded to 2N elements; a rank holds the *whole* gradient of every
    tensor that overlaps its partition (simulated tensor by tensor when the shapes are known).
    ZeRO-1 keeps full gradients until the accumulation boundary; bf16 ZeRO-1 with fp32
    accumulation is DeepSpeed's BF16_Optimizer (fp32 gradients for every parameter).
  - ZeRO-3 keeps tensors of at most stage3_param_persistence_threshold elements whole.
* buffers (held all along): reduce buckets (allocated in full on CUDA; on a CPU only the part
  that is written becomes resident), ZeRO-3's fp32 step-gradient buffer (one optimizer
  sub-group), the communication workspaces of gloo (two DDP buckets) and of DeepSpeed's CPU
  shared-memory all-reduce.
* backward work: 16-bit weight copies under autocast, ZeRO-0's flattened all-reduce buffer,
  ZeRO-3's gathered parameters (at most stage3_max_live_parameters) and one full gradient.
* optimizer-step work: torch AdamW's temporaries (single-tensor on CPU: two copies of the
  largest tensor it steps, which under ZeRO-1/2 is a whole flat partition; foreach on CUDA: one
  copy of everything; fused: none), the fp32 gradient partition ZeRO hands to it.

On CPU it predicts what the kernel charges a rank's memory cgroup at its peak (memory.max_usage
of bench/memcap.py's cgroups; BENCHMARKS.md, fit frontier) with compact malloc, where memory
follows live tensors (train/launch/device_memory.py); glibc's default keeps freed blocks on top,
so the memory check turns compact on where that growth would not fit (train/launch/host_settings.py).
On CUDA it predicts
torch.cuda.max_memory_allocated; the allocator's cache comes on top (the headroom).

Where this differs from DeepSpeed's own estimators (estimate_zero2_model_states_mem_needs /
estimate_zero3_model_states_mem_needs): they assume 16-bit params always (wrong for fp32
runs), count the step's fp32 gradient copy as a permanent 4Ψ/N ("18Ψ/N"), ignore the
buckets, activations, transients, persistent ZeRO-3 tensors and ZeRO-1, and multiply CPU
memory by a blanket 1.5 "buffer factor". See BENCHMARKS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from train import paths

if TYPE_CHECKING:
    from train.launch.device_memory import Budget

GiB = 2 ** 30
MiB = 2 ** 20

# Fastest first: same communication as DDP, then more communication, then PCIe traffic.
OPTIONS = (("DDP", "ddp.json"), ("ZeRO-1", "zero1.json"), ("ZeRO-2", "zero2.json"), ("ZeRO-3", "zero3.json"),
           ("ZeRO-2 + opt offload", "zero2_offload.json"), ("ZeRO-3 + param/opt offload", "zero3_offload.json"))

# DeepSpeed 0.19's zero_optimization defaults (deepspeed/runtime/zero/config.py).
ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "contiguous_gradients": True,
                 "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                 "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9}
ALLREDUCE_BUCKET = 5e8        # engine.allreduce_gradients' flatten size under ZeRO-0
DDP_BUCKET_CAP_MB = 25        # torch DDP's default bucket_cap_mb
# DeepSpeed's CPU all-reduce (deepspeed/ops/csrc/cpu/comm/shm.cpp): a shared-memory workspace of
# 2 x 32 MiB per rank (+ small-message buffers), charged to the rank that creates it.
DS_CPU_COMM_WORKSPACE = 64 * MiB
# What a CPU rank's owned memory grows by while its Accelerator starts, on top of Device.runtime
# (measured before the process group exists): DeepSpeed's communication backend and comm op
# 41.7 MiB, DDP 2.9 MiB (gpt-tiny, 2 ranks, torchrun and the deepspeed launcher alike; issue 30).
STARTUP = {"deepspeed": 48 * MiB, "ddp": 4 * MiB}


# ----------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class ModelShape:
    name: str
    num_params: int
    # numel of every trainable tensor, per optimizer group, in the order DeepSpeed flattens them
    groups: tuple
    gpt: object = None          # models.gpt.GPTConfig for activations; None = parameter count only
    width: Optional[int] = None  # hidden size: fills the JSON's "auto" ZeRO sizes (train/dsconfig.AUTO_SIZES)
    frozen: tuple = ()          # numel of parameters without gradients (held, never stepped)
    leaf_block: int = 0         # numel of the largest sparse-MoE block: gathered whole under ZeRO-3 (models/moe.py)
    active_params: Optional[int] = None  # mixture of experts: parameters one token uses (FLOPs); None = all

    @property
    def tensors(self) -> list[int]:
        return [n for g in self.groups for n in g]

    @property
    def shapes_known(self) -> bool:
        return len(self.tensors) > 1


@dataclass(frozen=True)
class Strategy:
    """One DeepSpeed JSON reduced to what costs memory."""

    label: str
    path: Optional[str]
    backend: str                # "ddp" | "deepspeed"
    stage: Optional[int]
    precision: str              # "bf16" | "fp16" | "fp32"
    offload_optimizer: bool = False
    offload_param: bool = False
    zero: dict = field(default_factory=dict)
    bucket_view: bool = True    # DDP gradient_as_bucket_view
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB
    grad_accum_fp32: bool = False  # 16-bit training accumulating gradients in fp32 (data_types)
    notes: tuple = ()

    def z(self, key):
        return float(self.zero.get(key, ZERO_DEFAULTS.get(key, 0)))

    @property
    def overlap_comm(self) -> bool:
        return bool(self.zero.get("overlap_comm", self.stage == 3))


@dataclass(frozen=True)
class Batch:
    micro: int
    seq_len: Optional[int]
    accum: int = 1
    checkpointing: bool = False
    sequence_parallel: int = 1  # distributed.sequence_parallel: each rank holds seq_len / N of a row
    document_mask: bool = False  # data.packing / data.document_mask: the GPT's (B, 1, T, T) mask, once


@dataclass(frozen=True)
class Device:
    """What the planned ranks run on. kind "cuda": bytes allocated on the GPU (the budget is its
    free memory); "cpu": resident bytes of a process whose device is host RAM. runtime: bytes
    the process owns before its process group and Accelerator exist (CPU: the libraries,
    ~0.36 GiB owned; CUDA: 0); on a CPU the estimate adds the option's own start-up (STARTUP)."""

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


# ----------------------------------------------------------------------------- model shapes

def gpt_shape(name: str, cfg) -> ModelShape:
    """Tensor sizes of models/gpt.py's GPT, grouped exactly like train/optim.param_groups
    (decayed matrices first, then norms and the embedding; a tied lm_head counts once)."""
    d, kv, f = cfg.d_model, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim
    decay, no_decay = [], [cfg.vocab_size * d]               # tok_emb (an Embedding: not decayed)
    for _ in range(cfg.n_layer):
        no_decay.append(d)                                    # attn_norm
        decay += [d * (d + 2 * kv), d * d]                    # qkv, proj
        no_decay.append(d)                                    # mlp_norm
        decay += [d * 2 * f, f * d]                           # gate_up, down
    no_decay.append(d)                                        # final norm
    if not cfg.tie_embeddings:
        decay.append(d * cfg.vocab_size)                      # lm_head
    return ModelShape(name, sum(decay) + sum(no_decay), (tuple(decay), tuple(no_decay)), cfg, width=d)


def count_shape(n: int) -> ModelShape:
    return ModelShape(f"{n / 1e6:.1f}M params", n, ((n,),), None)


def module_shape(model, name: str, gpt=None, width: Optional[int] = None) -> ModelShape:
    """From a built (possibly ZeRO-3-partitioned) model, grouped like the trainer's optimizer."""
    from train.optim.optimizer import param_groups
    groups = tuple(tuple(int(getattr(p, "ds_numel", p.numel())) for p in g["params"])
                   for g in param_groups(model, 0.1))
    frozen = tuple(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if not p.requires_grad)
    total = sum(map(sum, groups)) + sum(frozen)
    moe = _moe_sizes(model)
    return ModelShape(name, total, groups, gpt, width=width or (gpt.d_model if gpt is not None else None),
                      frozen=frozen, leaf_block=moe.largest_block_params if moe else 0,
                      active_params=total - moe.active_params_delta if moe else None)


def _moe_sizes(model):
    """models/moe.py's view of a sparse mixture-of-experts model (None for a dense one)."""
    from models.moe import detect
    return detect(model, getattr(model, "config", None))


# ----------------------------------------------------------------------------- strategies

def strategy_from_json(label: str, path: Path, precision: Optional[str] = None,
                       width: Optional[int] = None) -> Strategy:
    from train.dsconfig import precision_of, read_ds_json
    ds = read_ds_json(path)
    prec = precision or precision_of(path, ds)
    if "ddp" in ds:
        return Strategy(label, str(path), "ddp", None, prec,
                        bucket_view=bool(ds["ddp"].get("gradient_as_bucket_view", False)),
                        bucket_cap_mb=float(ds["ddp"].get("bucket_cap_mb", DDP_BUCKET_CAP_MB)))
    zero = dict(ds.get("zero_optimization") or {"stage": 0})
    return _zero_strategy(label, str(path), prec, zero, ds.get("data_types"), width)


def strategy_from_setup(ds) -> Strategy:
    """From train.dsconfig.DSSetup (the trainer's resolved JSON: no "auto" left)."""
    if not ds.is_deepspeed:
        return Strategy(ds.describe(), ds.path, "ddp", None, ds.precision,
                        bucket_view=bool(ds.ddp_kwargs.get("gradient_as_bucket_view", False)),
                        bucket_cap_mb=float(ds.ddp_kwargs.get("bucket_cap_mb", DDP_BUCKET_CAP_MB)))
    return _zero_strategy(ds.describe(), ds.path, ds.precision, dict(ds.resolved.get("zero_optimization", {})),
                          ds.resolved.get("data_types"))


def _zero_strategy(label, path, precision, zero, data_types=None, width=None) -> Strategy:
    from train.dsconfig import ACCUM_DTYPES, AUTO_SIZES

    def on(block):
        return (zero.get(block) or {}).get("device") not in (None, "none")
    notes = []
    for k, v in list(zero.items()):
        if isinstance(v, str) and v.lower() == "auto":
            if width and k in AUTO_SIZES:
                zero[k] = AUTO_SIZES[k](width)   # what train/dsconfig.py fills for this model
            else:
                zero.pop(k)                      # no width known: DeepSpeed's default stands in
                notes.append('"auto" ZeRO sizes need the model width: DeepSpeed\'s defaults shown '
                             '(5e8-element buckets; a run sizes them from its model)')
    stage = int(zero.get("stage", 0))
    accum = (data_types or {}).get("grad_accum_dtype")
    # train/dsconfig.py fills fp32 accumulation for bf16 from stage 1 when the JSON is silent.
    fp32_accum = (ACCUM_DTYPES.get(str(accum).lower()) == "fp32") if accum else (precision == "bf16" and stage >= 1)
    return Strategy(label, path, "deepspeed", stage, precision, on("offload_optimizer"), on("offload_param"), zero,
                    grad_accum_fp32=fp32_accum and precision != "fp32", notes=tuple(dict.fromkeys(notes)))


# ----------------------------------------------------------------------------- the arithmetic

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


def activation_bytes(cfg, batch: Batch, elem: int) -> int:
    """Saved activations of models/gpt.py at the start of backward, per device.

    Per token and layer: RMSNorms keep fp32 input and normalised copies (2 x 2D x 4 bytes);
    attention keeps the qkv input and output, roped q and k, the SDPA output (flash/efficient
    kernels: no T x T matrix) and the proj input (6D + 3kv elements with the MLP input D),
    plus fp32 log-sum-exp per head; SwiGLU keeps gate/up, silu(gate) and their product (4F).
    The head keeps the final norm, lm_head input and fp32 log-probs (+ their gradient and
    the logits while backward starts). Packed rows and document-masked windows add the document
    mask: one (micro, 1, T, T) tensor in the compute dtype that every layer saves (models/gpt.py
    document_mask), not one per layer. Checked against saved-tensor hooks in tests/test_plan.py.
    Sequence parallelism (N): a rank holds 1/N of each row's tokens and every saved tensor is per
    token (attention's q, k, v, output: the whole row for 1/N of the heads, the same count), so
    everything divides by N but the document mask (attention sees whole rows); the all-to-all
    buffers are sp_exchange_bytes."""
    d, kv, f, v, h = cfg.d_model, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_head
    layer = 16 * d + elem * (6 * d + 3 * kv + 4 * f) + 4 * h
    head = 8 * d + elem * d + 4 * v + (4 + elem) * v + 16
    T = batch.seq_len or cfg.seq_len
    tokens = batch.micro * T // batch.sequence_parallel
    mask = batch.micro * T * T * elem if batch.document_mask else 0
    if batch.checkpointing:
        # Only block inputs are saved; one block is recomputed (fully) during backward.
        return tokens * (cfg.n_layer * elem * d + layer + head) + mask
    return tokens * (cfg.n_layer * layer + head) + mask


def sp_exchange_bytes(cfg, batch: Batch, elem: int) -> int:
    """Ulysses' all-to-all buffers at their peak, transient in forward (and again for the gradients
    in backward): q, k and v of one layer each as a contiguous send copy and a receive buffer
    (models/sequence_parallel.py), 2 x (D + 2 kv) elements per local token; 0 without SP."""
    if batch.sequence_parallel <= 1:
        return 0
    tokens = batch.micro * (batch.seq_len or cfg.seq_len) // batch.sequence_parallel
    return 2 * elem * tokens * (cfg.d_model + 2 * cfg.n_kv_head * cfg.head_dim)


def _adam_work(device: Device, largest: int, total: int, fused: bool = False) -> int:
    """torch AdamW's temporaries for one step() over tensors of `total` elements, the largest
    `largest`: on CPU the single-tensor path builds sqrt(v) and its quotient for one tensor at a
    time (2 copies of the largest); on CUDA the foreach path one copy of everything; fused none."""
    if device.kind == "cpu":
        return 8 * largest
    return 0 if fused else 4 * total


def estimate(shape: ModelShape, s: Strategy, world: int, batch: Batch, rank: Optional[int] = None,
             device: Device = CUDA) -> Estimate:
    """Peak bytes per device for one rank (`rank`), or the largest over all ranks (None)."""
    b = 4 if s.precision == "fp32" else 2
    acc = 4 if s.grad_accum_fp32 else b          # bytes of an accumulated gradient element
    psi, n = shape.num_params, world
    trained = sum(shape.tensors)
    cpu = device.kind == "cpu"
    act = activation_bytes(shape.gpt, batch, b) if shape.gpt is not None else None
    notes = list(s.notes) + ([] if shape.gpt is not None else ["activations unknown (parameter count only)"])
    # Without real shapes: no straddling tensors, no single tensor larger than a bucket.
    largest = max(shape.tensors) if shape.shapes_known else 0
    if not shape.shapes_known:
        notes.append("transients of single tensors unknown (parameter count only)")

    # The same runtime whichever path asks (the memory check, --ds-config auto, zerotrain plan).
    runtime = device.runtime + (STARTUP[s.backend] if cpu and device.runtime else 0)

    exchange = sp_exchange_bytes(shape.gpt, batch, b) if shape.gpt is not None else 0

    def finish(**kw) -> Estimate:
        kw["backward_work"] = kw.get("backward_work", 0) + exchange  # SP: the all-to-all buffers
        e = Estimate(s, activations=act, runtime=runtime, device_kind=device.kind, notes=notes, **kw)
        for k in ("params", "grads", "optimizer", "buffers", "host", "backward_work", "step_work"):
            setattr(e, k, int(getattr(e, k)))
        return e

    if s.backend == "ddp":
        # Accelerate autocast: fp32 params and grads; 16-bit weight copies live until backward.
        # gloo all-reduces a bucket through its own send/receive copies; zerotrain's DDP AdamW is fused on CUDA.
        return finish(params=4 * psi, grads=4 * trained * (1 if s.bucket_view else 2), optimizer=8 * trained,
                      buffers=2 * s.bucket_cap_mb * MiB if cpu and n > 1 else 0, host=0,
                      comm=1.0 if n > 1 else None, backward_work=2 * psi if b == 2 else 0,
                      step_work=_adam_work(device, largest, trained, fused=True))

    comm_ws = DS_CPU_COMM_WORKSPACE if cpu and n > 1 else 0
    if s.stage == 0:
        flatten = b * min(trained, ALLREDUCE_BUCKET) if n > 1 else 0
        if b == 4:   # the torch optimizer steps the fp32 params directly
            return finish(params=4 * psi, grads=4 * trained, optimizer=8 * trained, buffers=comm_ws, host=0,
                          comm=1.0 if n > 1 else None, backward_work=flatten,
                          step_work=_adam_work(device, largest, trained))
        # FP16_UnfusedOptimizer: 16-bit params and grads, fp32 master copies; fp32 gradients made at the step.
        return finish(params=b * psi, grads=b * trained, optimizer=12 * trained, buffers=comm_ws, host=0,
                      comm=1.0 if n > 1 else None, backward_work=flatten,
                      step_work=4 * trained + _adam_work(device, largest, trained))

    rbs = s.z("reduce_bucket_size")
    if s.stage in (1, 2):
        ranks = range(n) if rank is None else [rank]
        owned, held = max((_zero12_partition(shape.groups, n, r) for r in ranks), key=lambda oh: oh[1])
        group_part = max(math.ceil(sum(g) / (2 * n)) * 2 for g in shape.groups)  # largest flat partition stepped
        if not shape.shapes_known:
            held = owned
        comm = (1.0 if s.stage == 1 else (batch.accum + 1) / 2) if n > 1 else None
        # Reduce buckets (doubled by overlap_comm): allocated whole on CUDA, written up to what fills them on CPU.
        bucket = int(min(rbs, trained) if cpu else rbs) * b * (2 if s.overlap_comm else 1)
        if s.stage == 1 and s.precision == "bf16" and s.grad_accum_fp32 and not s.offload_optimizer:
            # DeepSpeed's BF16_Optimizer: bf16 params and their bf16 grads, fp32 gradient accumulators
            # for every parameter (the partition AdamW steps is a view of them).
            return finish(params=2 * psi, grads=(2 + 4) * trained, optimizer=12 * owned, buffers=comm_ws, host=0,
                          comm=comm, step_work=_adam_work(device, group_part, owned))
        grads = acc * (trained if s.stage == 1 and batch.accum > 1 else held)
        if s.offload_optimizer:
            # Host: fp32 master + fp32 grads + moments + a 16-bit staging copy of the partition, a
            # largest-tensor bounce buffer, and (accumulating) per-tensor gradient accumulators.
            host = (4 + 4 + 8 + b) * owned + b * largest + (b * held if batch.accum > 1 else 0)
            # DeepSpeedCPUAdam steps in place; around it the host holds an fp32 gradient partition and a
            # copy of the updated partition in the training dtype (measured on CPU: 2 x 4 x owned in fp32).
            return finish(params=b * psi, grads=0, optimizer=0, buffers=bucket + b * largest + comm_ws, host=host,
                          comm=comm, pcie=b * owned * (batch.accum + 1), backward_work=b * largest,
                          step_work=(4 + b) * owned if cpu else 0)
        # The step hands AdamW an fp32 copy of the gradient partition.
        return finish(params=b * psi, grads=grads, optimizer=12 * owned, buffers=bucket + comm_ws, host=0, comm=comm,
                      backward_work=b * largest, step_work=4 * owned + _adam_work(device, group_part, owned))

    # ZeRO-3: every tensor split into ceil(numel / N) pieces; small ones also kept whole.
    threshold = s.z("stage3_param_persistence_threshold")
    tensors = list(shape.tensors) + list(shape.frozen)
    part = sum(math.ceil(t / n) for t in shape.tensors)
    frozen_part = sum(math.ceil(t / n) for t in shape.frozen)
    persistent = sum(t for t in tensors if t <= threshold)
    partitioned = sum(t for t in tensors if t > threshold)
    group_part = max(sum(math.ceil(t / n) for t in g) for g in shape.groups)
    sub_group = int(min(s.z("sub_group_size"), group_part))          # one optimizer sub-group
    # A ZeRO-3 leaf block (all experts of one MoE layer) is gathered as one unit, whatever the limit.
    gathered = b * int(max(min(partitioned, s.z("stage3_max_live_parameters")), shape.leaf_block))
    ipg = int(min(rbs, largest or trained) if cpu else rbs) * b
    comm = 1.5 * batch.accum if n > 1 else None
    params_dev, grads_dev, opt_dev = b * (part + frozen_part) + b * persistent, acc * part, 12 * part
    host = pcie = 0
    # stage3.py initialize_optimizer_states: an fp32 gradient buffer of the largest sub-group, kept.
    step_buffer = 4 * sub_group
    step_work = 4 * sub_group + _adam_work(device, sub_group, sub_group)
    if s.offload_optimizer:
        # + the fp32 gradient partition Adam reads, kept allocated on the host between steps; the
        # CPU optimizer steps in place.
        host += grads_dev + opt_dev + 4 * part
        grads_dev = opt_dev = step_buffer = step_work = 0
        pcie += b * part * (batch.accum + 1)
    if s.offload_param:
        host += b * (part + frozen_part)
        params_dev -= b * (part + frozen_part)
        pcie += 2 * b * part * batch.accum
    if not shape.shapes_known:
        notes.append("ZeRO-3 persistence not modelled (parameter count only)")
    return finish(params=params_dev, grads=grads_dev, optimizer=opt_dev, buffers=step_buffer + ipg + comm_ws,
                  host=host, comm=comm, pcie=pcie, backward_work=gathered + b * largest, step_work=step_work)


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
    batch: Batch
    safety: float
    rows: list
    recommended: Optional[Estimate]
    device: Device = CUDA

    def to_dict(self) -> dict:
        return {"model": self.shape.name, "num_params": self.shape.num_params,
                "trained_params": sum(self.shape.tensors), "cluster": vars(self.cluster), "world": self.cluster.world, "batch": vars(self.batch),
                "device": vars(self.device), "safety": self.safety, "options": [r.to_dict() for r in self.rows],
                "recommended": self.recommended.strategy.label if self.recommended else None,
                "recommended_ds_config": self.recommended.strategy.path if self.recommended else None}


def make_plan(shape: ModelShape, cluster: Cluster, batch: Batch, precision: str = "bf16", safety: float = 0.1,
              configs_dir: Path = paths.DS_CONFIGS, device: Device = CUDA) -> Plan:
    """Every option of OPTIONS (the JSONs in `configs_dir`) for this model and cluster. An
    option `fits` when its predicted peak is at most the device memory; the recommendation is
    the fastest one that also leaves `safety` of it free (estimation error, allocator cache)."""
    rows = []
    for label, fname in OPTIONS:
        path = Path(configs_dir) / fname
        s = (strategy_from_json(label, path, precision, shape.width) if path.is_file()
             else _fallback_strategy(label, fname, precision))
        rows.append(judge(estimate(shape, s, cluster.world, batch, device=device), cluster, safety))
    best = next((r for r in rows if r.fits and r.device_total <= (1 - safety) * cluster.device_mem), None)
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


def _fallback_strategy(label, fname, precision) -> Strategy:
    """DeepSpeed defaults when ds_configs/ is not next to the package."""
    if fname == "ddp.json":
        return Strategy(label, None, "ddp", None, precision)
    stage = int(fname[4])
    zero = {"stage": stage}
    if "offload" in fname:
        zero["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
    return _zero_strategy(label, None, precision, zero)


# ----------------------------------------------------------------------------- the trainer's banner

def banner_estimate(model, cfg, ds, batch, world: int, gpt=None, seq_len: Optional[int] = None,
                    rank: Optional[int] = None, device: Device = CUDA,
                    width: Optional[int] = None) -> tuple[str, Estimate]:
    """One line for the start-up banner (and the numbers) for the strategy in use."""
    from train.observe.report import human_bytes
    shape = module_shape(model, cfg.model.name, gpt, width)
    e = estimate(shape, strategy_from_setup(ds), world,
                 Batch(batch.micro, seq_len, batch.accum, cfg.model.activation_checkpointing,
                       sequence_parallel=cfg.distributed.sequence_parallel,
                       document_mask=cfg.data.packing or cfg.data.document_mask), rank, device)
    # report.banner prints "model states <text> per rank (estimated)".
    text = (f"{human_bytes(e.model_states)} (params {human_bytes(e.params)}, grads {human_bytes(e.grads)}, "
            f"optimizer {human_bytes(e.optimizer)})"
            + (f" + activations {human_bytes(e.activations)}" if e.activations is not None else "")
            + f" + buffers {human_bytes(e.buffers)}" + (f", host {human_bytes(e.host)}" if e.host else "")
            + f"; peak {human_bytes(e.device_total)}" + (" incl. the runtime" if e.runtime else ""))
    return text, e


@dataclass(frozen=True)
class RankPlan:
    """What the planner tells the running trainer about this rank (train/training/build.py makes
    it once): the banner's "model states" and "memory" lines, and the plan the measured mem/*
    metrics are logged next to (train/observe/memory.py)."""

    budget: Optional[Budget]      # the memory check's agreed budget (train/plan/fit.py); None: the check was off
    estimate: Optional[Estimate]  # this rank's plan; None when the planner cannot size the model
    text: str                     # the banner's text for the estimate, or why there is none


def rank_plan(model, cfg, ds, batch, topo, workload, seq_len: Optional[int],
              budget: Optional[Budget]) -> RankPlan:
    """This rank's plan for the running model (`model` unwrapped from its engine). A planner that
    cannot size this model says so in the banner rather than stopping the run."""
    from models.gpt import GPTConfig
    wc = workload.model_config
    gpt = GPTConfig.from_dict({k: v for k, v in wc.items() if k != "family"}) if wc.get("family") == "gpt" else None
    device = Device(budget.device, budget.runtime) if budget is not None else \
        Device("cuda" if topo.device == "cuda" else "cpu", 0)
    try:
        text, est = banner_estimate(model, cfg, ds, batch, topo.world_size, gpt, seq_len, rank=topo.rank,
                                    device=device, width=workload.hidden_size)
    except Exception as e:  # noqa: BLE001 - the estimate is advisory; the run goes on
        return RankPlan(budget, None, f"estimate unavailable ({type(e).__name__}: {e})")
    return RankPlan(budget, est, text)
