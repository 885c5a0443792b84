"""The ZeRO planner's arithmetic: what each ZeRO option costs per device, and the fastest
option that fits. The `zerotrain plan` command (flags, table) is train/plan_cli.py.

    zerotrain plan gpt-1.3b --gpus-per-node 8 --device-mem 80GB --micro-batch 8
    zerotrain plan runs/my_run.yaml --device-mem 24GiB --json
    zerotrain plan 7B --nodes 2 --gpus-per-node 8 --device-mem 80GB --cpu-mem 1TB

Model states follow what DeepSpeed 0.19 really allocates (read from its source and checked
against train/memory.py's measurement, see BENCHMARKS.md), not only the ZeRO paper's
16Ψ / 4Ψ+12Ψ/N / 2Ψ+14Ψ/N / 16Ψ/N for mixed-precision Adam:

* params / grads use the training dtype (b = 2 for bf16/fp16, 4 for fp32). DeepSpeed keeps a
  separate fp32 master partition even for fp32 training, so ZeRO-1/2/3 optimizer states
  are always 12 bytes per owned element (master 4 + Adam moments 8).
* DDP (Accelerate autocast) keeps fp32 params and grads whatever the precision: 16Ψ.
* ZeRO-1/2 flat groups are padded to 2N elements; a rank holds the *whole* gradient of every
  tensor that overlaps its partition (simulated tensor by tensor when the shapes are known).
* ZeRO-1 keeps full gradients between micro-batches when accumulating (it reduces only at the
  boundary); with one micro-batch per step it holds a partition like ZeRO-2.
* ZeRO-3 keeps tensors with numel <= stage3_param_persistence_threshold whole on every rank.
* "buffers": reduce buckets (reduce_bucket_size elements, doubled by overlap_comm for
  ZeRO-1/2; allocated once at start-up for ZeRO-3), the step's transient fp32 gradient
  partition, ZeRO-3's gathered parameters, DDP's autocast weight copies.

Where this differs from DeepSpeed's own estimators (estimate_zero2_model_states_mem_needs /
estimate_zero3_model_states_mem_needs): they assume 16-bit params always (wrong for fp32
runs), count the step's fp32 gradient copy as a permanent 4Ψ/N ("18Ψ/N"), ignore the
reduce buckets (1-4 GB with the shipped JSONs), activations, persistent ZeRO-3 tensors and
ZeRO-1, and multiply CPU memory by a blanket 1.5 "buffer factor". See BENCHMARKS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
GiB = 2 ** 30

# Fastest first: same communication as DDP, then more communication, then PCIe traffic.
OPTIONS = (("DDP", "ddp.json"), ("ZeRO-1", "zero1.json"), ("ZeRO-2", "zero2.json"), ("ZeRO-3", "zero3.json"),
           ("ZeRO-2 + opt offload", "zero2_offload.json"), ("ZeRO-3 + param/opt offload", "zero3_offload.json"))

# DeepSpeed 0.19's zero_optimization defaults (deepspeed/runtime/zero/config.py).
ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "contiguous_gradients": True,
                 "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                 "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9}
ALLREDUCE_BUCKET = 5e8   # engine.allreduce_gradients' flatten size under ZeRO-0


# ----------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class ModelShape:
    name: str
    num_params: int
    # numel of every trainable tensor, per optimizer group, in the order DeepSpeed flattens them
    groups: tuple
    gpt: object = None          # models.gpt.GPTConfig for activations; None = parameter count only

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


@dataclass
class Estimate:
    strategy: Strategy
    params: int
    grads: int
    optimizer: int
    activations: Optional[int]  # None: architecture unknown
    buffers: int
    host: int                   # offloaded bytes per rank (CPU memory)
    comm: Optional[float]       # communication volume per optimizer step, relative to DDP
    pcie: int = 0               # host<->device bytes per step and device (offload)
    fits: Optional[bool] = None
    notes: list = field(default_factory=list)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device_total(self) -> int:
        return self.model_states + (self.activations or 0) + self.buffers

    def to_dict(self) -> dict:
        return {"option": self.strategy.label, "ds_config": self.strategy.path, "stage": self.strategy.stage,
                "precision": self.strategy.precision,
                "device_bytes": {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                                 "activations": self.activations, "buffers": self.buffers,
                                 "model_states": self.model_states, "total": self.device_total},
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
    return ModelShape(name, sum(decay) + sum(no_decay), (tuple(decay), tuple(no_decay)), cfg)


def count_shape(n: int) -> ModelShape:
    return ModelShape(f"{n / 1e6:.1f}M params", n, ((n,),), None)


def module_shape(model, name: str, gpt=None) -> ModelShape:
    """From a built (possibly ZeRO-3-partitioned) model, grouped like the trainer's optimizer."""
    from train.optim import param_groups
    groups = tuple(tuple(int(getattr(p, "ds_numel", p.numel())) for p in g["params"])
                   for g in param_groups(model, 0.1))
    return ModelShape(name, sum(map(sum, groups)), groups, gpt)


# ----------------------------------------------------------------------------- strategies

def strategy_from_json(label: str, path: Path, precision: Optional[str] = None) -> Strategy:
    from train.dsconfig import _precision, read_ds_json
    ds = read_ds_json(path)
    prec = precision or _precision(path, ds)
    if "ddp" in ds:
        return Strategy(label, str(path), "ddp", None, prec,
                        bucket_view=bool(ds["ddp"].get("gradient_as_bucket_view", False)))
    zero = dict(ds.get("zero_optimization") or {"stage": 0})
    return _zero_strategy(label, str(path), prec, zero)


def strategy_from_setup(ds) -> Strategy:
    """From train.dsconfig.DSSetup (the trainer's resolved JSON)."""
    if not ds.is_deepspeed:
        return Strategy(ds.describe(), ds.path, "ddp", None, ds.precision,
                        bucket_view=bool(ds.ddp_kwargs.get("gradient_as_bucket_view", False)))
    return _zero_strategy(ds.describe(), ds.path, ds.precision, dict(ds.resolved.get("zero_optimization", {})))


def _zero_strategy(label, path, precision, zero) -> Strategy:
    def on(block):
        return (zero.get(block) or {}).get("device") not in (None, "none")
    for k, v in list(zero.items()):
        if isinstance(v, str) and v.lower() == "auto":
            zero.pop(k)   # no hidden size here: DeepSpeed's default stands in
    return Strategy(label, path, "deepspeed", int(zero.get("stage", 0)), precision,
                    on("offload_optimizer"), on("offload_param"), zero)


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
    the logits while backward starts). Checked against saved-tensor hooks in tests/test_plan.py."""
    d, kv, f, v, h = cfg.d_model, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_head
    layer = 16 * d + elem * (6 * d + 3 * kv + 4 * f) + 4 * h
    head = 8 * d + elem * d + 4 * v + (4 + elem) * v + 16
    tokens = batch.micro * (batch.seq_len or cfg.seq_len)
    if batch.checkpointing:
        # Only block inputs are saved; one block is recomputed (fully) during backward.
        return tokens * (cfg.n_layer * elem * d + layer + head)
    return tokens * (cfg.n_layer * layer + head)


def estimate(shape: ModelShape, s: Strategy, world: int, batch: Batch, rank: Optional[int] = None) -> Estimate:
    """Per-device bytes for one rank (`rank`), or the largest over all ranks (None)."""
    b = 4 if s.precision == "fp32" else 2
    psi, n = shape.num_params, world
    act = activation_bytes(shape.gpt, batch, b) if shape.gpt is not None else None
    notes = [] if shape.gpt is not None else ["activations unknown (parameter count only)"]
    # Without real shapes: no straddling tensors, no single tensor larger than a bucket.
    largest = max(shape.tensors) if shape.shapes_known else 0

    if s.backend == "ddp":
        # Accelerate autocast: fp32 params and grads; bf16 copies of the weights live until backward.
        grads = 4 * psi * (1 if s.bucket_view else 2)
        buffers = 2 * psi if s.precision != "fp32" else 0
        return _finish(Estimate(s, 4 * psi, grads, 8 * psi, act, buffers, 0, 1.0 if n > 1 else None, notes=notes))

    if s.stage == 0:
        flatten = min(psi, ALLREDUCE_BUCKET) * b if n > 1 else 0
        if b == 4:   # the torch optimizer steps the fp32 params directly
            return _finish(Estimate(s, 4 * psi, 4 * psi, 8 * psi, act, flatten, 0, 1.0 if n > 1 else None,
                                    notes=notes))
        # FP16_Optimizer: 16-bit params and grads + a flat fp32 master copy; fp32 grads at the step.
        return _finish(Estimate(s, b * psi, b * psi, 12 * psi, act, max(flatten, 4 * psi), 0,
                                1.0 if n > 1 else None, notes=notes))

    rbs = s.z("reduce_bucket_size")
    if s.stage in (1, 2):
        ranks = range(n) if rank is None else [rank]
        owned, held = max((_zero12_partition(shape.groups, n, r) for r in ranks), key=lambda oh: oh[1])
        if not shape.shapes_known:
            held = owned
        if s.stage == 1 and batch.accum > 1:
            held = psi       # full gradients wait for the accumulation boundary
        buckets = int(rbs) * b * (2 if s.overlap_comm else 1)
        comm = (1.0 if s.stage == 1 else (batch.accum + 1) / 2) if n > 1 else None
        if s.offload_optimizer:
            # Host: fp32 master + fp32 grads + moments + a 16-bit staging copy of the partition, a
            # largest-tensor bounce buffer, and (accumulating) per-tensor gradient accumulators.
            host = (4 + 4 + 8 + b) * owned + b * largest + (b * held if batch.accum > 1 else 0)
            est = Estimate(s, b * psi, 0, 0, act, buckets + b * largest, host, comm,
                           pcie=b * owned * (batch.accum + 1), notes=notes)
        else:
            est = Estimate(s, b * psi, b * held, 12 * owned, act, max(buckets, 4 * owned), 0, comm, notes=notes)
        return _finish(est)

    # ZeRO-3: every tensor split into ceil(numel / N) pieces; small ones also kept whole.
    part = sum(math.ceil(t / n) for t in shape.tensors)
    persistent = sum(t for t in shape.tensors if t <= s.z("stage3_param_persistence_threshold"))
    gathered = b * int(min(psi, s.z("stage3_max_live_parameters"), largest + s.z("stage3_prefetch_bucket_size")))
    step_grad = 4 * int(min(part, s.z("sub_group_size")))
    buffers = int(rbs) * b + max(gathered, 0 if s.offload_optimizer else step_grad)
    comm = 1.5 * batch.accum if n > 1 else None
    host = 0
    params_dev, grads_dev, opt_dev = b * part + b * persistent, b * part, 12 * part
    pcie = 0
    if s.offload_optimizer:
        # + the fp32 gradient partition Adam reads, kept allocated on the host between steps
        host += grads_dev + opt_dev + 4 * part
        grads_dev = opt_dev = 0
        pcie += b * part * (batch.accum + 1)
    if s.offload_param:
        host += b * part
        params_dev -= b * part
        pcie += 2 * b * part * batch.accum
    if not shape.shapes_known:
        notes.append("ZeRO-3 persistence not modelled (parameter count only)")
    return _finish(Estimate(s, params_dev, grads_dev, opt_dev, act, buffers, host, comm, pcie=pcie, notes=notes))


def _finish(e: Estimate) -> Estimate:
    e.params, e.grads, e.optimizer, e.buffers, e.host = map(int, (e.params, e.grads, e.optimizer, e.buffers, e.host))
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
    batch: Batch
    safety: float
    rows: list
    recommended: Optional[Estimate]

    def to_dict(self) -> dict:
        return {"model": self.shape.name, "num_params": self.shape.num_params,
                "cluster": vars(self.cluster), "world": self.cluster.world, "batch": vars(self.batch),
                "safety": self.safety, "options": [r.to_dict() for r in self.rows],
                "recommended": self.recommended.strategy.label if self.recommended else None,
                "recommended_ds_config": self.recommended.strategy.path if self.recommended else None}


def make_plan(shape: ModelShape, cluster: Cluster, batch: Batch, precision: str = "bf16", safety: float = 0.1,
              configs_dir: Path = REPO / "ds_configs") -> Plan:
    rows = []
    for label, fname in OPTIONS:
        path = configs_dir / fname
        s = (strategy_from_json(label, path, precision) if path.is_file()
             else _fallback_strategy(label, fname, precision))
        e = estimate(shape, s, cluster.world, batch)
        device_ok = e.device_total <= (1 - safety) * cluster.device_mem
        host_ok = (cluster.cpu_mem is None
                   or e.host * cluster.devices_per_node <= (1 - safety) * cluster.cpu_mem)
        e.fits = device_ok and host_ok
        if device_ok and not host_ok:
            e.notes.append("offloaded states exceed the CPU memory")
        rows.append(e)
    best = next((r for r in rows if r.fits), None)
    return Plan(shape, cluster, batch, safety, rows, best)


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
                    rank: Optional[int] = None) -> tuple[str, Estimate]:
    """One line for the start-up banner (and the numbers) for the strategy in use."""
    from train.report import human_bytes
    shape = module_shape(model, cfg.model.name, gpt)
    e = estimate(shape, strategy_from_setup(ds), world,
                 Batch(batch.micro, seq_len, batch.accum, cfg.model.activation_checkpointing), rank)
    # report.banner prints "model states <text> per rank (estimated)".
    text = (f"{human_bytes(e.model_states)} (params {human_bytes(e.params)}, grads {human_bytes(e.grads)}, "
            f"optimizer {human_bytes(e.optimizer)})"
            + (f" + activations {human_bytes(e.activations)}" if e.activations is not None else "")
            + f" + buffers {human_bytes(e.buffers)}" + (f", host {human_bytes(e.host)}" if e.host else ""))
    return text, e


def attach_estimate(trainer) -> None:
    """Sets trainer.memory_estimate (the banner's line) and trainer.memory_plan (this rank's
    Estimate, compared with the measurement by train/memory.py). A planner that cannot size
    this model says so in the banner rather than stopping the run."""
    from models.gpt import GPTConfig
    wc = trainer.workload.model_config
    gpt = GPTConfig.from_dict({k: v for k, v in wc.items() if k != "family"}) if wc.get("family") == "gpt" else None
    try:
        model = trainer.acc.unwrap_model(trainer.model)
        text, est = banner_estimate(model, trainer.cfg, trainer.ds, trainer.batch, trainer.topo.world_size, gpt,
                                    trainer.data.seq_len, rank=trainer.topo.rank)
    except Exception as e:  # noqa: BLE001 - the estimate is advisory; the run goes on
        trainer.memory_estimate, trainer.memory_plan = f"estimate unavailable ({type(e).__name__}: {e})", None
        return
    trainer.memory_estimate, trainer.memory_plan = text, est
