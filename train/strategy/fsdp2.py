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
shards; fp32 computes in fp32. fp16 computes in fp16 the same way (gradients reduced in fp32),
with a dynamic loss scale (train/strategy/loss_scale.py DynamicScale: DDP's GradScaler rule and
"fp16" keys, the overflow decided on the global gradient norm, so every rank skips together;
the scale is saved with checkpoints). fp16 needs a CUDA GPU, as for every backend.

Every rank but 0 builds the model on the meta device; rank 0 builds it as every backend does,
and its values fill each rank's shards as the model is sharded (`init_context`, `shard`): one
whole copy in the job, the initial values of every other backend.

Accelerate builds the process group, splits the global batch and runs backward; it does not
prepare the model: its own FSDP plugin needs a GPU, while zerotrain shards the same way on
CPUs (gloo) and GPUs, here. Checkpoints go through `ShardHolder`: a parameter's shard is a
contiguous element range of the flattened parameter, so checkpoints move to and from every
other backend and world size (train/checkpoint/load.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

import zerotrain.train.strategy.cost as cost
import zerotrain.train.strategy.ds_config as ds_config
import zerotrain.train.strategy.loss_scale as loss_scale
import zerotrain.train.strategy.registry as registry
from zerotrain.train.errors import ConfigError, did_you_mean
from zerotrain.train.strategy.base import HALF_DTYPES, Strategy, param_projection
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

# Strategy.malloc_figures: glibc's growth is FSDP2's own (the cgroup peak under glibc over the
# peak under compact malloc, both reshard settings: 1.18; BENCHMARKS.md "FSDP2 beside ZeRO",
# bench/results/allocator-20261207-135646). The compact cost is ZeRO-3's, the backend with the
# same life of its memory (units gathered and freed every forward and backward): FSDP2's step
# times there were taken on a shared machine and are not a measurement.
GLIBC_GROWTH, COMPACT_COST = 1.18, 0.62
STARTUP = 4 * cost.MiB   # what DDP's Accelerator costs at start-up: the same Accelerator here


@dataclass(frozen=True)
class FSDP2Settings(registry.Settings):
    """What FSDP2 alone reads from a strategy file: its "fsdp" block (FSDP_KEYS). Made by `setup`
    (a run) and `_option` / `_default_option` (the planner)."""

    #: a unit's gathered parameters freed after its forward and gathered again for its backward
    #: (ZeRO-3's trade); False keeps them until the backward (one all-gather fewer)
    reshard_after_forward: bool = True
    #: fp16: the loss scale's arguments from the file's "fp16" block (loss_scale.grad_scaler_args:
    #: DDP's GradScaler keys); None: no loss scaling (bf16, fp32; and a planner's option)
    grad_scaler: Optional[dict] = None


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
    # fp16: the loss scale's settings from the "fp16" block, DDP's keys and refusals
    scaler = loss_scale.grad_scaler_args(path, ds["fp16"], "FSDP2's loss scale") if precision == "fp16" else None
    return ds_config.DSSetup(path=str(path), backend="fsdp2", precision=precision,
                             settings=FSDP2Settings(**settings, grad_scaler=scaler), resolved=ds)


def describe(ds) -> str:
    keep = "" if ds.settings.reshard_after_forward else ", kept after forward"
    return f"FSDP2{keep} ({ds.precision})"


# ------------------------------------------------------------------ the strategy
class FSDP2Strategy(Strategy):
    backend = "fsdp2"
    #: where the model is sharded (the Accelerator's device: build_accelerator sets it)
    device = torch.device("cpu")
    #: this rank's model was built on the meta device (build_optimizer: shard)
    built_empty = False
    #: fp16's loss scale (prepare makes it); None in bf16 and fp32
    scaler: Optional[loss_scale.DynamicScale] = None

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
        # fp16: no Accelerate GradScaler (none on CPU): the policy casts, the strategy scales (DynamicScale).
        mixed = "no" if self.precision == "fp16" else self.ds.accelerate_mixed_precision
        acc = build_accelerator(mixed, batch, timeout_s, (),
                                cpu=not torch.cuda.is_available())
        self.device = acc.device
        return acc

    def init_context(self):
        """Every rank but 0 builds the model on the meta device (shapes, no memory); rank 0 builds it
        as every backend does, and `shard` fills each rank's shards from that build. One whole copy
        in the job (rank 0's, on its host) instead of one per rank, and the initial values are the
        ones every other backend starts from (the same seed, the same construction)."""
        import torch.distributed as dist
        if dist.get_rank() == 0:
            return super().init_context()
        from zerotrain.models.partitioned import EmptyInit
        return EmptyInit()

    def place_frozen_copy(self, module, device):
        """DPO's frozen copy is whole on every rank: made from the model before it is sharded, so
        on ranks but 0 it has shapes only; rank 0's values are broadcast into it."""
        fill_from_rank0(module, device)
        return module

    def build_optimizer(self, model, optim_cfg):
        """AdamW over the shards: FSDP2 replaces each parameter by its DTensor shard, so the model is
        sharded here, before the optimizer that steps the shards exists. The fused kernel (CUDA and
        CPU) skips a non-finite step on the device (found_inf), as DDP's does."""
        from zerotrain.train.optim.optimizer import adamw
        self.built_empty = shard(model, self.device, self.reshard_after_forward, self.precision)
        return adamw(model, optim_cfg, fused=True)

    def prepare(self, acc, model, raw_optimizer, *loaders):
        """The optimizer and loaders through accelerate.prepare; the sharded model as it is (a DDP
        wrapper around it would all-reduce the shards)."""
        self.acc, self.raw_optimizer, self.engine = acc, raw_optimizer, model
        self.optimizer, *prepared = acc.prepare(raw_optimizer, *loaders)
        if self.precision == "fp16":
            self.scaler = loss_scale.DynamicScale(self.device, **self.ds.settings.grad_scaler)
        return prepared

    # ------------------------------------------------------------------ one step
    def backward(self, loss) -> None:
        """fp16: the loss times the scale (DynamicScale)."""
        super().backward(self.scaler.scaled(loss) if self.scaler is not None else loss)

    def step(self, clip: float):
        """The global norm over every shard (each rank's sum of squares, all-reduced: a DTensor
        reduction), clipping by it, then the step; a non-finite norm skips the step on every rank.
        fp16: the gradients are unscaled first, and the same norm decides the scale's update."""
        grads = [p.grad for p in self.engine.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(grads)
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_([p for p in self.engine.parameters() if p.grad is not None],
                                                 clip, norm)
        self.raw_optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update(self.raw_optimizer.found_inf)
        return norm

    # ------------------------------------------------------------------ fp16
    def loss_scale(self):
        return self.scaler.current() if self.scaler is not None else None

    def state_dict(self) -> dict:
        """fp16: the scale as DDP's GradScaler records it (kind "torch"), so it moves between the two."""
        return {"loss_scaler": {"kind": "torch", **self.scaler.state_dict()}} if self.scaler is not None else {}

    def load_state_dict(self, state: dict, at) -> None:
        s = state.get("loss_scaler")
        if s and self.scaler is not None and s.get("kind") == "torch":
            self.scaler.load_state_dict(s)

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
        """Under bf16 (fp16) the units compute with their parameters cast to bf16 (fp16)
        (MixedPrecisionPolicy; buffers stay as they are): the frozen copy's parameters are cast the
        same way, so at step 1 it gives the policy's log-probs (the precision from the strategy
        file: no process group needed)."""
        half = HALF_DTYPES.get(self.precision)
        if half is not None:
            for p in module.parameters():
                p.data = p.data.to(half)
        return module

    def compute_form(self, device_type: str) -> str:
        if self.precision == "fp32":
            return "fp32"
        return f"{self.precision} parameters, buffers as built (fsdp2) on {device_type}"

    # ------------------------------------------------------------------ checkpoints and memory
    def after_prepare(self, workload) -> dict:
        """How this rank's model came to be: on the meta device and filled from rank 0, or whole."""
        return {"model_built": "meta device, filled from rank 0" if self.built_empty else "whole"}

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


def shard_range(shape: tuple, rank: int, world: int) -> tuple[int, int]:
    """The element range [a, b) of a flattened parameter of `shape` that `rank` holds: FSDP2 splits
    its R rows like torch.chunk, rank r owning rows [min(R, r*ceil(R/W)), min(R, (r+1)*ceil(R/W)))."""
    n = math.prod(shape)
    rows = shape[0] if shape else 1
    per_row, chunk = (n // rows if rows else 0), -(-rows // world)
    return min(rows, rank * chunk) * per_row, min(rows, (rank + 1) * chunk) * per_row


def _named_states(module: torch.nn.Module) -> list:
    """(name, tensor) of every parameter, then every buffer (persistent or not): what a build
    gives a module, in the same order on every rank."""
    return list(module.named_parameters()) + list(module.named_buffers())


def fill_from_rank0(module: torch.nn.Module, device) -> None:
    """A module whole on every rank, with rank 0's values: ranks that built it on the meta device
    get memory on `device` and every parameter and buffer is broadcast from rank 0."""
    import torch.distributed as dist
    if any(t.is_meta for _, t in _named_states(module)):
        _empty_on(module, device)
    else:
        module.to(device)
    if dist.get_world_size() > 1:
        with torch.no_grad():
            for _, t in _named_states(module):
                _broadcast(t.data)


def _empty_on(module: torch.nn.Module, device) -> None:
    """Memory on `device` for every meta tensor of `module`, a tensor shared by two modules (tied
    embeddings) still one tensor (Module.to_empty would make it two)."""
    made: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    new = torch.empty_like(t, device=device)
                    made[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                table[name] = made[id(t)]


def shard(model: torch.nn.Module, device, reshard_after_forward: bool, precision: str) -> bool:
    """fully_shard each unit, then the root, over a one-dimensional mesh of every rank, on `device`
    (each unit moved there as it is sharded: never the whole model at once), then every rank's
    shards and buffers filled from rank 0's build (the other ranks built on the meta device:
    FSDP2Strategy.init_context). True where this rank's model was built on the meta device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    # Rank 0's whole values, kept from before fully_shard replaces each parameter by its shard.
    whole = {name: t.detach() for name, t in model.named_parameters()} if rank == 0 and world > 1 else None
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    half = HALF_DTYPES.get(precision)
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
    return _fill_shards(model, whole, device, rank, world) if world > 1 else False


def _fill_shards(model: torch.nn.Module, whole: Optional[dict], device, rank: int, world: int) -> bool:
    """Every parameter broadcast whole from rank 0 (`whole`: its values, on rank 0 only), one at a
    time, each rank keeping its shard; every buffer broadcast as it is. A rank that built on the
    meta device gets its memory first (to_empty: shards and buffers on `device`); True there."""
    import torch.distributed as dist
    empty = any(_local(t).is_meta for _, t in _named_states(model))
    if empty:
        model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)  # the whole parameter's (a DTensor's global shape)
            if whole is not None:
                full = whole[name].to(device=device, dtype=p.dtype)
            else:
                full = torch.empty(shape, dtype=p.dtype, device=device)
            dist.broadcast(full, 0)
            a, b = shard_range(shape, rank, world)
            _local(p).view(-1).copy_(full.view(-1)[a:b])
        for _, t in model.named_buffers():
            _broadcast(t.data)
    return empty


def _broadcast(t: torch.Tensor) -> None:
    """`t` in place from rank 0 (a bool tensor as its bytes: gloo reduces no bool)."""
    import torch.distributed as dist
    dist.broadcast(t.view(torch.uint8) if t.dtype == torch.bool else t, 0)


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
            a, b = shard_range(shape, rank, world)
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
