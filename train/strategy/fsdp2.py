"""PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`; a strategy file with an "fsdp" block):
every parameter is a DTensor sharded on its first dimension over all ranks; each repeated block
(the elements of the model's outermost ModuleLists: a GPT's blocks, a transformers model's
layers) is one unit all-gathered for its forward and backward, the rest of the model the root
unit. The optimizer is torch's AdamW over the fp32 shards; gradients are reduce-scattered in
fp32 after each micro-batch's backward.

    {"fsdp": {"reshard_after_forward": true}, "bf16": {"enabled": true}, ...}

`reshard_after_forward` true frees a unit's gathered parameters after its forward and gathers
them again for its backward (ZeRO-3's trade: least memory, one more all-gather per step); false
keeps them from the forward to the backward (ZeRO-2-like memory for the parameters in flight,
one all-gather fewer). bf16 computes in bf16 (FSDP2's MixedPrecisionPolicy) over fp32 master
shards; fp32 computes in fp32.

Accelerate builds the process group, splits the global batch and runs backward; it does not
prepare the model: its own FSDP plugin needs a GPU, while zerotrain shards the same way on
CPUs (gloo) and GPUs, here. Checkpoints go through `ShardHolder`: a parameter's shard is a
contiguous element range of the flattened parameter, so checkpoints move to and from every
other backend and world size (train/checkpoint/load.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

import zerotrain.train.strategy.cost as cost
import zerotrain.train.strategy.ds_config as ds_config
import zerotrain.train.strategy.registry as registry
from zerotrain.train.errors import ConfigError, did_you_mean
from zerotrain.train.strategy.base import Strategy, param_projection
from zerotrain.train.strategy.holders import Slot, TorchOptimizerHolder, named_unique_params
from zerotrain.train.strategy.option import Option

BLOCK = "fsdp"
#: the "fsdp" block's keys, their type and default
FSDP_KEYS = {"reshard_after_forward": (bool, True)}
#: top-level keys of other backends; FSDP2 cannot honour them (ZeRO's offload, DeepSpeed's
#: accumulation dtype, DDP's options)
NOT_FSDP = tuple(ds_config.DEEPSPEED_ONLY) + ("data_types", "ddp", "zero_force_ds_cpu_optimizer")

#: the keys every strategy file may have (train/strategy/ds_config.py fills or checks them); a
#: DeepSpeed logging key means nothing here either
SHARED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
               "gradient_clipping", "bf16", "fp16")

# Strategy.malloc_figures: (glibc growth, compact cost) as measured for ZeRO-3, the backend with
# the same life of its memory (units gathered and freed every forward and backward); FSDP2's own
# are not measured (BENCHMARKS.md "Host allocator on CPU").
GLIBC_GROWTH, COMPACT_COST = 1.50, 0.62
STARTUP = 4 * cost.MiB   # what DDP's Accelerator costs at start-up: the same Accelerator here


@dataclass(frozen=True)
class FSDP2Settings(registry.Settings):
    """What FSDP2 alone reads from a strategy file: its "fsdp" block (FSDP_KEYS). Made by `setup`
    (a run) and `_option` / `_default_option` (the planner)."""

    #: a unit's gathered parameters freed after its forward and gathered again for its backward
    #: (ZeRO-3's trade); False keeps them until the backward (one all-gather fewer)
    reshard_after_forward: bool = True


# ------------------------------------------------------------------ the file's block
def setup(path, ds: dict, precision: str, hidden_size: Optional[int] = None, sizes_later: bool = False):
    """An "fsdp" file: its block checked (every key known, of its type), nothing of another backend."""
    stray = [k for k in NOT_FSDP if k in ds]
    if stray:
        raise ConfigError(f'{path}: an "fsdp" file (FSDP2) cannot also set "{stray[0]}": FSDP2 cannot honour '
                          f"{'DDP' if stray[0] == 'ddp' else 'DeepSpeed'}'s keys; remove it, or use a "
                          f"{'ds_configs/ddp.json' if stray[0] == 'ddp' else 'ds_configs/zero*.json'} file")
    other = [k for k in ds if k not in SHARED_KEYS and k != BLOCK]
    if other:
        raise ConfigError(f'{path}: "{other[0]}" is not a key of an FSDP2 file{did_you_mean(other[0], SHARED_KEYS)}; '
                          f"valid: {', '.join(SHARED_KEYS)}, {BLOCK}")
    block = ds[BLOCK]
    if not isinstance(block, dict):
        raise ConfigError(f'{path}: "{BLOCK}" must be an object like {{"reshard_after_forward": true}}')
    settings = {}
    for k, (kind, default) in FSDP_KEYS.items():
        v = block.get(k, default)
        if not isinstance(v, kind):
            raise ConfigError(f'{path}: "{BLOCK}.{k}" must be true or false (got {v!r})')
        settings[k] = v
    for k in block:
        if k not in FSDP_KEYS:
            raise ConfigError(f'{path}: "{BLOCK}.{k}" is not an FSDP2 option{did_you_mean(k, FSDP_KEYS)}; '
                              f"valid: {', '.join(FSDP_KEYS)}")
    if precision == "fp16":
        raise ConfigError(f'{path}: FSDP2 with fp16 (loss scaling) is not supported by zerotrain; set '
                          f'"bf16": {{"enabled": true}} (or both disabled for fp32), or use ds_configs/zero2_fp16.json')
    return ds_config.DSSetup(path=str(path), backend="fsdp2", precision=precision, settings=FSDP2Settings(**settings),
                             resolved=ds)


def describe(ds) -> str:
    keep = "" if ds.settings.reshard_after_forward else ", kept after forward"
    return f"FSDP2{keep} ({ds.precision})"


# ------------------------------------------------------------------ the strategy
class FSDP2Strategy(Strategy):
    backend = "fsdp2"
    #: where the model is sharded (the Accelerator's device: build_accelerator sets it)
    device = torch.device("cpu")

    @property
    def reshard_after_forward(self) -> bool:
        return self.ds.settings.reshard_after_forward

    def record(self) -> dict:
        return {"backend": self.backend, "zero_stage": None, "precision": self.precision,
                "reshard_after_forward": self.reshard_after_forward}

    # ------------------------------------------------------------------ checks and build
    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if cfg.hardware.compile:
            raise ConfigError(f"hardware.compile with FSDP2 ({self.path}) is not supported by zerotrain; use "
                              f"ds_configs/ddp.json or a zero0-2 file, or set hardware.compile false")

    def check_sequence_parallel(self, flag: str) -> None:
        raise ConfigError(f"{flag} needs a ZeRO DeepSpeed JSON, not FSDP2 ({self.path}): FSDP2 shards over every "
                          f"rank, so ranks of one sequence group would average gradients of the same samples; use "
                          f"e.g. --strategy ds_configs/zero3.json or set distributed.sequence_parallel 1")

    def check_channels_last(self, cfg, want: Optional[bool], family: str, cuda: bool) -> bool:
        """FSDP2 keeps each parameter as contiguous dim-0 shards, which undoes the layout."""
        if want:
            raise ConfigError(f"model.channels_last: FSDP2 ({self.path}) shards parameters into contiguous pieces, "
                              f"which undoes the channels-last layout; use ds_configs/ddp.json or remove it")
        return False

    def build_accelerator(self, batch, timeout_s: int):
        """Accelerate's process group, batches and backward; not its FSDP plugin (GPUs only)."""
        import os

        from zerotrain.train.launch.distributed import build_accelerator
        # An accelerate YAML with distributed_type FSDP (train/launch/ds_config_choice.py fsdp_file
        # read its settings) would make Accelerate wrap the model itself: zerotrain shards it.
        os.environ.pop("ACCELERATE_USE_FSDP", None)
        acc = build_accelerator(self.ds.accelerate_mixed_precision, batch, timeout_s, (),
                                cpu=not torch.cuda.is_available())
        self.device = acc.device
        return acc

    def build_optimizer(self, model, optim_cfg):
        """AdamW over the shards: FSDP2 replaces each parameter by its DTensor shard, so the model is
        sharded here, before the optimizer that steps the shards exists. The fused kernel (CUDA and
        CPU) skips a non-finite step on the device (found_inf), as DDP's does."""
        from zerotrain.train.optim.optimizer import adamw
        shard(model, self.device, self.reshard_after_forward, self.precision)
        return adamw(model, optim_cfg, fused=True)

    def prepare(self, acc, model, raw_optimizer, *loaders):
        """The optimizer and loaders through accelerate.prepare; the sharded model as it is (a DDP
        wrapper around it would all-reduce the shards)."""
        self.acc, self.raw_optimizer, self.engine = acc, raw_optimizer, model
        self.optimizer, *prepared = acc.prepare(raw_optimizer, *loaders)
        return prepared

    # ------------------------------------------------------------------ one step
    def step(self, clip: float):
        """The global norm over every shard (each rank's sum of squares, all-reduced: a DTensor
        reduction), clipping by it, then the step; a non-finite norm skips the step on every rank."""
        grads = [p.grad for p in self.engine.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in self.engine.parameters() if p.grad is not None],
                                                 clip, norm)
        self.raw_optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def param_checksum(self, origin: list | None = None) -> tuple[float, float, float]:
        """Each parameter gathered whole in turn (every rank: a collective); `origin` as the base
        class's (a 1-process run's whole copy)."""
        from zerotrain.train.strategy.base import _origin_of
        total, offset = torch.zeros(3, dtype=torch.float64), 0
        for i, p in enumerate(self.engine.parameters()):
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            total, offset = total + param_projection(whole, offset, _origin_of(origin, i, whole)), offset + whole.numel()
        return float(total[0]), float(total[1]), float(total[2])

    def frozen_like_policy(self, module: torch.nn.Module) -> torch.nn.Module:
        """Under bf16 the units compute with their parameters cast to bf16 (MixedPrecisionPolicy;
        buffers stay as they are): the frozen copy's parameters are cast the same way, so at step 1
        it gives the policy's log-probs."""
        if self.precision == "bf16":
            for p in module.parameters():
                p.data = p.data.to(torch.bfloat16)
        return module

    # ------------------------------------------------------------------ checkpoints and memory
    def make_holder(self, raw_model, rank: int, world: int):
        return ShardHolder(raw_model, self.raw_optimizer, rank, world)

    def measure_model_states(self, model, raw_optimizer):
        """Local shards of the parameters, gradients and moments; the unsharded parameters a unit
        holds while gathered count as "gathered"."""
        from zerotrain.train.observe.memory import Counter
        c = Counter(not torch.cuda.is_available())
        params = list(model.parameters())
        c.add("params", "fsdp2.shard", [_local(p) for p in params])
        c.add("grads", "fsdp2.grad_shard", [_local(p.grad) for p in params if p.grad is not None])
        for st in raw_optimizer.state.values():
            c.add("optimizer", "optimizer.state", [_local(v) for v in st.values() if torch.is_tensor(v)])
        c.add("optimizer", "fp32_master", [])
        c.out.optimizer_state_ready = any(len(s) for s in raw_optimizer.state.values())
        return c.out

    @property
    def malloc_figures(self) -> tuple[float, float]:
        return GLIBC_GROWTH, COMPACT_COST


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules sharded as units before the root: the elements of the outermost ModuleLists
    (repeated blocks), outermost first (no unit holds another)."""
    out, seen = [], set()
    for name, m in model.named_modules():
        if any(name.startswith(p) for p in seen):
            continue
        if isinstance(m, torch.nn.ModuleList):
            seen.add(name + ".")
            out += [b for b in m if any(True for _ in b.parameters())]
    return out


def shard(model: torch.nn.Module, device, reshard_after_forward: bool, precision: str) -> None:
    """fully_shard each unit, then the root, over a one-dimensional mesh of every rank, on `device`."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    model.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    half = torch.bfloat16 if precision == "bf16" else None
    # Only the root casts its float inputs: a block gets the activations the model computed (a
    # model that keeps its residual stream in fp32 keeps it here, as under ZeRO's bf16 weights).
    unit_mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for unit in units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=unit_mp)
    # The root keeps its own parameters (embeddings, head) gathered after forward: its backward comes last.
    fully_shard(model, mesh=mesh, reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32))
    # A parameter without a gradient on one rank (a sparse-MoE expert its tokens did not reach)
    # joins its unit's reduce-scatter with zeros, so every rank reduces the same tensors.
    model.set_reduce_scatter_unused_params(True)


# ------------------------------------------------------------------ checkpoints
class ShardHolder(TorchOptimizerHolder):
    """FSDP2: parameter p of R rows is split like torch.chunk, rank r owning rows
    [min(R, r*ceil(R/W)), min(R, (r+1)*ceil(R/W))): a contiguous element range of the flattened
    parameter, held as the DTensor's local tensor (the optimizer's moments are sharded alike)."""

    name = "fsdp2"

    def __init__(self, model, optimizer, rank: int, world: int):
        super().__init__()
        self.optimizer = optimizer
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        for name, p in named_unique_params(model):
            shape, n = tuple(p.shape), p.numel()
            rows = shape[0] if shape else 1
            per_row, chunk = (n // rows if rows else 0), -(-rows // world)
            a, b = min(rows, rank * chunk) * per_row, min(rows, (rank + 1) * chunk) * per_row
            if _local(p).numel() != b - a:
                raise RuntimeError(f"FSDP2 holds {_local(p).numel()} elements of {name} on rank {rank}, "
                                   f"not the {b - a} of torch.chunk's rows")
            self.slots.append(Slot(name, p, shape, n, id(p) in stepped, (a, b), (a, b)))

    def _flat(self, slot, kind) -> Optional[torch.Tensor]:
        if kind == "param":
            return _local(slot.param).detach().view(-1)
        st = self.optimizer.state.get(slot.param)
        return _local(st[kind]).view(-1) if st else None

    def source(self, slot, kind):
        return self._flat(slot, kind)

    def held(self, slot):
        return self._flat(slot, "param")

    def write(self, slot, kind, values):
        with torch.no_grad():
            self._flat(slot, kind).copy_(values)

    def full_param(self, slot):
        p = slot.param
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        return whole.detach().float().cpu().reshape(slot.shape).clone()


# ------------------------------------------------------------------ the planner
def _option(label: str, path, precision: str, ds: dict, width=None) -> Option:
    block = ds.get(BLOCK) if isinstance(ds.get(BLOCK), dict) else {}
    return Option(label, path, "fsdp2", precision,
                  FSDP2Settings(reshard_after_forward=bool(block.get("reshard_after_forward", True))))


def _default_option(label: str, fname: str, precision: str) -> Option:
    return Option(label, None, "fsdp2", precision, FSDP2Settings(reshard_after_forward="keep" not in fname))


def _cost(r, batch, rank: Optional[int] = None) -> tuple[dict, list]:
    """Every tensor split into ceil(rows / N)-row shards: fp32 parameters (the masters), fp32
    gradients and two moments per shard element (counted as ceil(numel / N): the same bytes
    wherever rows divide evenly, a row more per tensor where they do not). While a unit computes, its parameters are
    whole in the training dtype with their whole gradients, and the next unit is prefetched;
    kept after forward, every unit's gathered parameters stay until its backward."""
    shape, n, b = r.shape, r.n, r.b
    part = sum(-(-t // n) for t in shape.tensors)
    frozen_part = sum(-(-t // n) for t in shape.frozen)
    layers = getattr(shape.gpt, "n_layer", 0) or 1
    unit = max(shape.num_params // layers, r.largest, shape.leaf_block)
    gathered = b * (shape.num_params if not r.s.settings.reshard_after_forward else 2 * unit)
    caveats = [] if shape.gpt is not None else ["FSDP2 unit size estimated as the largest tensor (no layer count)"]
    # The fused AdamW keeps a 4-byte step count per trained tensor.
    return dict(params=4 * (part + frozen_part), grads=4 * part, optimizer=8 * part + 4 * len(shape.tensors), master=part,
                buffers=0, host=0, comm=1.5 * batch.accum if n > 1 else None,
                backward_work=gathered + b * unit + 4 * unit,
                step_work=cost._adam_work(r.device, -(-r.largest // n), part, fused=True)), caveats


registry.register(registry.Backend(
    name="fsdp2", block=BLOCK, strategy=FSDP2Strategy, setup=setup, option=_option,
    default_option=_default_option, cost=_cost, startup=STARTUP, splits_sequences=False, describe=describe,
    # Not candidates of --ds-config auto (its choice among DDP and ZeRO stays as it was); last in
    # the verify matrix.
    options=(registry.PlannerOption(6, "FSDP2, kept after forward", "fsdp2_keep.json", auto=False),
             registry.PlannerOption(7, "FSDP2", "fsdp2.json", auto=False))))
