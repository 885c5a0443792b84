"""`zerotrain plan`: what each ZeRO option costs per device before you launch, and the
fastest option that fits.

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

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from train.errors import ConfigError

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


def parse_count(text: str) -> Optional[int]:
    """'124M', '1.3B', '7e9', '350000000' -> int; None if it is not a count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)])


def parse_bytes(text: str, flag: str) -> int:
    """'80GB' (1e9), '80GiB' / '80G' (2^30), '1.5TB', '512MiB'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", str(text).lower())
    if not m or (not m.group(2) and (m.group(3) or m.group(4))):
        raise ConfigError(f"{flag} {text!r} is not a size; write e.g. 80GB, 80GiB or 141G")
    power = "kmgt".index(m.group(2)) + 1 if m.group(2) else 0
    decimal = m.group(4) and not m.group(3)   # "GB" is decimal like GPU datasheets; "G"/"GiB" binary
    return int(float(m.group(1)) * ((1000 if decimal else 1024) ** power))


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


def _gib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def render(plan: Plan) -> str:
    c, b = plan.cluster, plan.batch
    head = (f"zerotrain plan: {plan.shape.name} ({plan.shape.num_params / 1e6:,.1f}M params), "
            f"{c.nodes} node(s) x {c.devices_per_node} device(s) = {c.world}, {c.device_mem / GiB:.1f} GiB/device"
            + (f", {c.cpu_mem / GiB:.0f} GiB CPU/node" if c.cpu_mem else "")
            + f"\n  batch: micro {b.micro} x seq {b.seq_len} x accum {b.accum}, activation checkpointing "
            + ("on" if b.checkpointing else "off") + f", {plan.rows[0].strategy.precision}")
    cols = ("option", "params", "grads", "optim", "activ", "buffers", "device", "host/node", "comm", "fits")
    table = [cols]
    for r in plan.rows:
        table.append((r.strategy.label, _gib(r.params), _gib(r.grads), _gib(r.optimizer), _gib(r.activations),
                      _gib(r.buffers), _gib(r.device_total), _gib(r.host * c.devices_per_node) if r.host else "-",
                      f"{r.comm:.1f}x" if r.comm is not None else "-", "yes" if r.fits else "NO"))
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [head, "", "  GiB per device (host/node: offloaded states per node)"]
    for i, row in enumerate(table):
        lines.append("  " + "  ".join(v.ljust(w) if j == 0 else v.rjust(w) for j, (v, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    usable = (1 - plan.safety) * c.device_mem / GiB
    if plan.recommended:
        r = plan.recommended
        lines.append(f"\nrecommended: {r.strategy.label}  (--ds-config {_rel(r.strategy.path)}): the fastest option "
                     f"whose {r.device_total / GiB:.2f} GiB fits in {usable:.1f} GiB ({plan.safety:.0%} headroom)")
    else:
        lines.append(f"\nnothing fits in {usable:.1f} GiB per device ({plan.safety:.0%} headroom): "
                     + _advice(plan))
    notes = sorted({n for r in plan.rows for n in r.notes})
    lines.append("\ncomm = volume per optimizer step relative to DDP's all-reduce (ZeRO paper); offload adds "
                 "PCIe traffic. buffers = reduce buckets, step-time fp32 gradients, gathered ZeRO-3 params.")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _advice(plan: Plan) -> str:
    tips = []
    if not plan.batch.checkpointing and plan.shape.gpt is not None:
        tips.append("--activation-checkpointing")
    if plan.batch.micro > 1:
        tips.append("a smaller --micro-batch (raise accumulation instead)")
    tips.append("more devices or nodes")
    return "try " + ", ".join(tips)


def _rel(path: Optional[str]) -> str:
    if not path:
        return "-"
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path


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


# ----------------------------------------------------------------------------- command line

USAGE = """usage: zerotrain plan MODEL [--nodes N] [--gpus-per-node G] [--device-mem SIZE] [--cpu-mem SIZE]
                      [--micro-batch B] [--seq-len T] [--grad-accum K] [--activation-checkpointing]
                      [--precision bf16|fp16|fp32] [--safety 0.1] [--json]

MODEL is a GPT preset (gpt-tiny ... gpt-7b), a run file (.yaml/.json; its model, batch and
sequence length are used), or a parameter count (124M, 1.3B, 7e9). Sizes: 80GB (decimal,
as on datasheets), 80GiB or 80G (binary). Defaults: this machine's GPUs if it has any,
else 1 node x 8 devices x 80GB. Prints per-device memory of DDP, ZeRO-1/2/3 and the two
offload options (from ds_configs/*.json) and recommends the fastest that fits.
"""

FLAGS = {"--nodes": int, "--gpus-per-node": int, "--device-mem": str, "--cpu-mem": str, "--micro-batch": int,
         "--seq-len": int, "--grad-accum": int, "--precision": str, "--safety": float}


def parse_args(argv: list[str]) -> dict:
    out = {"json": False, "activation_checkpointing": None, "model": None}
    i = 0
    while i < len(argv):
        a = argv[i]
        name, _, inline = a.partition("=")
        if name in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if name == "--json":
            out["json"] = True
        elif name == "--activation-checkpointing":
            out["activation_checkpointing"] = True
        elif name in FLAGS:
            if not inline:
                i += 1
                if i >= len(argv):
                    raise ConfigError(f"{name} needs a value (see zerotrain plan --help)")
                inline = argv[i]
            try:
                out[name[2:].replace("-", "_")] = FLAGS[name](inline)
            except ValueError:
                raise ConfigError(f"{name} {inline!r} is not a {FLAGS[name].__name__}") from None
        elif a.startswith("-"):
            from train.errors import did_you_mean
            raise ConfigError(f"unknown option {a!r}{did_you_mean(name, list(FLAGS) + ['--json'])}; "
                              f"see zerotrain plan --help")
        elif out["model"] is None:
            out["model"] = a
        else:
            raise ConfigError(f"one MODEL only (got {out['model']!r} and {a!r})")
        i += 1
    if out["model"] is None:
        raise ConfigError("zerotrain plan needs a MODEL: a GPT preset (e.g. gpt-1.3b), a run file or a parameter "
                          "count (e.g. 7B); see zerotrain plan --help")
    return out


def resolve_model(spec: str) -> tuple[ModelShape, dict]:
    """(shape, batch defaults from a run file)."""
    from models import gpt
    if spec in gpt.PRESETS:
        return gpt_shape(spec, gpt.PRESETS[spec]), {}
    if Path(spec).suffix in (".yaml", ".yml", ".json") or Path(spec).is_file():
        from models import _gpt_config
        from train.config import load_config
        cfg = load_config(spec)
        if cfg.model.name not in gpt.PRESETS:
            raise ConfigError(f"{spec}: model.name {cfg.model.name!r} is not a GPT preset; zerotrain plan sizes "
                              f"GPTs from the run file, other models by parameter count (e.g. zerotrain plan 25M)")
        gcfg = _gpt_config(cfg.model, vocab_size=None)
        return gpt_shape(cfg.model.name, gcfg), {
            "micro_batch": cfg.train.micro_batch_size, "seq_len": cfg.data.seq_len or gcfg.seq_len,
            "grad_accum": cfg.train.grad_accum_steps or 1,
            "activation_checkpointing": cfg.model.activation_checkpointing}
    n = parse_count(spec)
    if n is None or n <= 0:
        from train.errors import did_you_mean
        raise ConfigError(f"MODEL {spec!r} is not a GPT preset{did_you_mean(spec, gpt.PRESETS)}, a run file or a "
                          f"parameter count; presets: {', '.join(gpt.PRESETS)}")
    return count_shape(n), {}


def _local_defaults() -> tuple[int, Optional[int]]:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory
    except Exception:  # noqa: BLE001 - a broken CUDA install must not stop planning
        pass
    return 8, None


def main(argv: list[str]) -> int:
    from train.cli import user_errors
    with user_errors():
        a = parse_args(argv)
        shape, run = resolve_model(a["model"])
        local_devices, local_mem = _local_defaults()
        device_mem = parse_bytes(a["device_mem"], "--device-mem") if a.get("device_mem") else (local_mem or 80 * 10**9)
        cpu_mem = parse_bytes(a["cpu_mem"], "--cpu-mem") if a.get("cpu_mem") else None
        cluster = Cluster(a.get("nodes", 1), a.get("gpus_per_node", local_devices), device_mem, cpu_mem)
        ckpt = a["activation_checkpointing"] if a["activation_checkpointing"] is not None else run.get(
            "activation_checkpointing", False)
        seq = a.get("seq_len") or run.get("seq_len") or (shape.gpt.seq_len if shape.gpt else None)
        batch = Batch(a.get("micro_batch") or run.get("micro_batch", 8), seq, a.get("grad_accum") or run.get(
            "grad_accum", 1), ckpt)
        for name, v in (("--nodes", cluster.nodes), ("--gpus-per-node", cluster.devices_per_node),
                        ("--micro-batch", batch.micro), ("--grad-accum", batch.accum)):
            if v <= 0:
                raise ConfigError(f"{name} must be a positive integer (got {v})")
        if shape.gpt is not None and seq > shape.gpt.seq_len:
            raise ConfigError(f"--seq-len {seq} exceeds {shape.name}'s context length {shape.gpt.seq_len}")
        precision = a.get("precision", "bf16")
        if precision not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"--precision must be bf16, fp16 or fp32 (got {precision!r})")
        safety = a.get("safety", 0.1)
        if not 0 <= safety < 1:
            raise ConfigError(f"--safety is a fraction of device memory kept free, in [0, 1) (got {safety})")
        plan = make_plan(shape, cluster, batch, precision, safety)
        print(json.dumps(plan.to_dict(), indent=1) if a["json"] else render(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


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
