"""Where this rank keeps each parameter's training state, for every strategy.

A checkpoint stores, per parameter, the fp32 master value and the AdamW moments as flat
element ranges. A *holder* answers, for the strategy this run uses:
  - `slot.save`: the range of the flattened parameter this rank writes (the ranges of all
    ranks tile [0, numel) exactly, so nothing is gathered to write a checkpoint);
  - `slot.need`: the range it must read back on load (its own partition, or everything
    for replicated strategies);
  - how to read / write those elements of the master weights and the moments.

  ReplicaHolder     DDP, and DeepSpeed ZeRO-0 in fp32 (the torch optimizer steps the params)
  MasterCopyHolder  DeepSpeed ZeRO-0 in bf16/fp16 (FP16_[Unfused]Optimizer: full fp32 copies)
  FragmentHolder    ZeRO-1/2 (and DeepSpeed's BF16_Optimizer): fp32 partitions mapped to
                    parameters by `param._hp_mapping` (deepspeed/utils/tensor_fragment.py)
  Zero3Holder       ZeRO-3: each parameter partitioned evenly, rank r owning [r*part, ...)

Reading allocates at most one parameter's range; writing goes in place. `source` is the range
itself, uncopied (on the device where it lives): checkpoint.async copies it into a reused host
buffer (train/checkpoint/background.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import zerotrain.train.strategy.internals as internals


@dataclass
class Slot:
    name: str
    param: torch.nn.Parameter
    shape: tuple
    numel: int
    trainable: bool               # has optimizer state (fp32 master + moments)
    save: tuple[int, int]          # [start, stop) this rank writes
    need: tuple[int, int]          # [start, stop) this rank reads back


def even_range(n: int, rank: int, world: int) -> tuple[int, int]:
    return n * rank // world, n * (rank + 1) // world


def named_unique_params(model) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters once each (a tied alias is skipped: named_parameters dedupes shared tensors)."""
    return list(model.named_parameters())


def copy_out(t: torch.Tensor) -> torch.Tensor:
    """An owned, contiguous fp32 CPU copy (safetensors refuses views sharing one storage)."""
    out = torch.empty(t.numel(), dtype=torch.float32)
    out.copy_(t.detach().reshape(-1))
    return out


# ---------------------------------------------------------------------------- optimizer state

def _is_cpu_adam(optimizer) -> bool:
    return type(optimizer).__name__ == "DeepSpeedCPUAdam"


def new_adam_state(optimizer, t: torch.Tensor) -> dict:
    """The state AdamW's first step() would create for tensor `t` (torch AdamW or
    DeepSpeedCPUAdam), so that moments can be loaded before any step has run."""
    if _is_cpu_adam(optimizer):
        return {"step": 0, "exp_avg": torch.zeros_like(t, dtype=torch.float32),
                "exp_avg_sq": torch.zeros_like(t, dtype=torch.float32)}
    d = optimizer.defaults
    on_device = d.get("fused") or d.get("capturable")
    step = torch.zeros((), dtype=torch.float32, device=t.device if on_device else "cpu")
    return {"step": step, "exp_avg": torch.zeros_like(t, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(t, memory_format=torch.preserve_format)}


def get_step(state: dict | None):
    if not state or "step" not in state:
        return 0
    s = float(state["step"])
    return int(s) if s.is_integer() else s


def set_step(state: dict, value):
    s = state.get("step")
    if torch.is_tensor(s):
        s.fill_(value)
    else:
        state["step"] = int(value)


# ---------------------------------------------------------------------------- holders

class Holder:
    name = "?"

    def __init__(self):
        self.slots: list[Slot] = []

    def begin_load(self):
        pass

    def source(self, slot: Slot, kind: str) -> torch.Tensor | None:
        """The elements `slot.save` of the fp32 master weight ("param") or of a moment, as they
        are held (not copied; possibly on the device); None: no state yet (zeros)."""
        raise NotImplementedError

    def held(self, slot: Slot) -> torch.Tensor:
        """The elements `slot.need` of a trained parameter's fp32 master value, as held: a flat
        view (no copy) that the optimizer step updates in place, so a copy of it kept beside the
        moments (train.ema) follows the weights with no gather and no host read. After writing
        into it, finish_load() refreshes the derived copies (low-precision weights, gathers)."""
        raise NotImplementedError

    def read(self, slot: Slot, kind: str) -> torch.Tensor:
        """An owned fp32 CPU copy of `source` (zeros for a moment not created yet)."""
        t = self.source(slot, kind)
        if t is None:
            a, b = slot.save
            return torch.zeros(b - a)
        return copy_out(t)

    def _state(self, slot: Slot) -> dict | None:
        """The optimizer-state dict that holds this slot's moments and step."""
        raise NotImplementedError

    def step_of(self, slot):
        return get_step(self._state(slot))

    def set_step(self, slot, value):
        set_step(self._state(slot), value)

    def prepare_moments(self):
        """Create missing optimizer state (optimizers create it lazily at the first step)."""

    def finish_load(self):
        """Refresh derived copies (low-precision weights, gathered persistent params)."""

    def full_param(self, slot: Slot) -> torch.Tensor:
        """The whole fp32 value. Collective under ZeRO: every rank calls it in slot order."""
        raise NotImplementedError


class TorchOptimizerHolder(Holder):
    """A holder whose torch optimizer steps the model's own parameters (keyed by them in its
    state): ReplicaHolder here, FSDP2's ShardHolder (fsdp2.py)."""

    optimizer = None

    def _state(self, slot):
        return self.optimizer.state.get(slot.param)

    def prepare_moments(self):
        for s in self.slots:
            if s.trainable and not self.optimizer.state.get(s.param):
                self.optimizer.state[s.param] = new_adam_state(self.optimizer, s.param)


class ReplicaHolder(TorchOptimizerHolder):
    """Every rank holds the whole model and optimizer: rank r writes 1/W of each tensor."""

    name = "replica"

    def __init__(self, model, optimizer, rank: int, world: int):
        super().__init__()
        self.optimizer = optimizer
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer else set()
        for name, p in named_unique_params(model):
            n = p.numel()
            self.slots.append(Slot(name, p, tuple(p.shape), n, id(p) in stepped, even_range(n, rank, world), (0, n)))

    def source(self, slot, kind):
        a, b = slot.save
        if kind == "param":
            return slot.param.detach().reshape(-1)[a:b]
        st = self.optimizer.state.get(slot.param)
        return st[kind].reshape(-1)[a:b] if st else None

    def held(self, slot):
        return slot.param.data.view(-1)

    def write(self, slot, kind, values):
        a, b = slot.need
        target = slot.param.data if kind == "param" else self.optimizer.state[slot.param][kind]
        target.view(-1)[a:b].copy_(values)

    def full_param(self, slot):
        return slot.param.detach().float().cpu().reshape(slot.shape)


class _LowPrecisionOnly:
    """Parameters without optimizer state under DeepSpeed ZeRO-0/1/2 (frozen ones): the
    module weight itself, replicated on every rank."""

    @staticmethod
    def slot(name, p, rank, world):
        n = p.numel()
        return Slot(name, p, tuple(p.shape), n, False, even_range(n, rank, world), (0, n))


class MasterCopyHolder(Holder):
    """DeepSpeed ZeRO-0 with bf16/fp16: full fp32 master copies on every rank, one flat tensor
    per param group (FP16_Optimizer, for fused Adam) or one tensor per parameter
    (FP16_UnfusedOptimizer, for torch AdamW); the optimizer state is keyed by those."""

    name = "master-copies"

    def __init__(self, model, ds_optimizer, rank: int, world: int):
        super().__init__()
        self.opt = ds_optimizer
        self.where = {}  # id(param) -> (tensor the optimizer steps, element offset in it)
        flats, per_param = internals.master_copies(ds_optimizer)
        for i, group in enumerate(internals.lp_groups(ds_optimizer)):
            off = 0
            for j, p in enumerate(group):
                self.where[id(p)] = (flats[i], off) if flats else (per_param[i][j], 0)
                off += p.numel()
        for name, p in named_unique_params(model):
            if id(p) in self.where:
                n = p.numel()
                self.slots.append(Slot(name, p, tuple(p.shape), n, True, even_range(n, rank, world), (0, n)))
            else:
                self.slots.append(_LowPrecisionOnly.slot(name, p, rank, world))

    def _master(self, slot, kind):
        t, off = self.where[id(slot.param)]
        src = t if kind == "param" else self.opt.optimizer.state[t][kind]
        return src.view(-1)[off:off + slot.numel]

    def source(self, slot, kind):
        a, b = slot.save
        if not slot.trainable:
            return slot.param.detach().reshape(-1)[a:b]
        if kind != "param" and not self._state(slot):
            return None
        return self._master(slot, kind)[a:b]

    def held(self, slot):
        return self._master(slot, "param")

    def write(self, slot, kind, values):
        a, b = slot.need
        target = self._master(slot, kind) if slot.trainable else slot.param.data.view(-1)
        target[a:b].copy_(values)

    def _state(self, slot):
        return self.opt.optimizer.state.get(self.where[id(slot.param)][0])

    def prepare_moments(self):
        base = self.opt.optimizer
        for t, _ in self.where.values():
            if not base.state.get(t):
                base.state[t] = new_adam_state(base, t)

    def finish_load(self):
        with torch.no_grad():  # the module's low-precision weights = cast of the masters, as after a step
            for s in self.slots:
                if s.trainable:
                    s.param.data.copy_(self._master(s, "param").view_as(s.param))

    def full_param(self, slot):
        t = self._master(slot, "param") if slot.trainable else slot.param.detach()
        return t.float().cpu().reshape(slot.shape).clone()


class FragmentHolder(Holder):
    """ZeRO-1/2: each param group is one flat fp32 tensor split evenly over the ranks; a
    parameter's `_hp_mapping` says which contiguous part of it (if any) this rank owns."""

    name = "fragments"

    def __init__(self, model, ds_optimizer, rank: int, world: int):
        super().__init__()
        self.opt = ds_optimizer
        groups = internals.bit16_groups(ds_optimizer)
        self.flats = internals.fp32_partitions(ds_optimizer)
        self.group_of = {id(p): i for i, g in enumerate(groups) for p in g}
        for name, p in named_unique_params(model):
            if id(p) not in self.group_of:
                self.slots.append(_LowPrecisionOnly.slot(name, p, rank, world))
                continue
            m = internals.hp_mapping(p)
            rng = internals.lp_fragment_range(m) if m is not None else (0, 0)
            self.slots.append(Slot(name, p, tuple(p.shape), p.numel(), True, rng, rng))

    def _moment(self, slot, kind):
        """This rank's fragment of a moment, cut from the flat partition's optimizer state.
        (Not `_hp_mapping.optim_fragment`: DeepSpeed links those once, after the first
        group's first step, so later param groups stay unlinked.)"""
        state = self._state(slot)
        if not state:
            return None
        start, numel = internals.hp_fragment_range(internals.hp_mapping(slot.param))
        return state[kind].narrow(0, start, numel)

    def source(self, slot, kind):
        a, b = slot.save
        if not slot.trainable:
            return slot.param.detach().reshape(-1)[a:b]
        if kind == "param":
            return internals.hp_fragment(internals.hp_mapping(slot.param))
        return self._moment(slot, kind)

    def held(self, slot):
        return internals.hp_fragment(internals.hp_mapping(slot.param)).data.view(-1)

    def write(self, slot, kind, values):
        if not slot.trainable:
            a, b = slot.need
            slot.param.data.view(-1)[a:b].copy_(values)
            return
        target = internals.hp_fragment(internals.hp_mapping(slot.param)) if kind == "param" else self._moment(slot, kind)
        target.data.copy_(values.view_as(target))

    def _state(self, slot):
        return self.opt.optimizer.state.get(self.flats[self.group_of[id(slot.param)]])

    def prepare_moments(self):
        base = self.opt.optimizer
        for flat in self.flats:
            if not base.state.get(flat):
                base.state[flat] = new_adam_state(base, flat)

    def finish_load(self):
        # Each rank casts its fp32 partition into the low-precision weights, then all-gather.
        internals.update_lp_params(self.opt)

    def full_param(self, slot):
        if not slot.trainable:
            return slot.param.detach().float().cpu().reshape(slot.shape).clone()
        from deepspeed.utils import safe_get_full_fp32_param
        return safe_get_full_fp32_param(slot.param).float().cpu().reshape(slot.shape)


class Zero3Holder(Holder):
    """ZeRO-3: parameter p of N elements is split into W partitions of ceil(N/W) (the last
    padded); rank r owns elements [r*part, min(N, (r+1)*part))."""

    name = "zero3"

    def __init__(self, model, ds_optimizer, rank: int, world: int):
        super().__init__()
        self.opt = ds_optimizer
        self.sub_group = {}
        for p in (q for g in internals.lp_groups(ds_optimizer) for q in g):
            self.sub_group[id(p)] = internals.sub_group(ds_optimizer, p)
        for name, p in named_unique_params(model):
            n, part = internals.full_numel(p), internals.partition_numel(p)
            r = internals.partition_rank(ds_optimizer, p) if id(p) in self.sub_group else rank
            start = min(n, r * part)
            rng = (start, min(n, start + part))
            self.slots.append(Slot(name, p, internals.full_shape(p), n, id(p) in self.sub_group, rng, rng))

    def _has_state(self, slot) -> bool:
        flat = internals.fp32_sub_groups(self.opt)[self.sub_group[id(slot.param)]]
        return bool(self.opt.optimizer.state.get(flat))

    def source(self, slot, kind):
        from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state
        a, b = slot.save
        if not slot.trainable:
            return internals.local_partition(slot.param)[:b - a]
        if kind == "param":
            return safe_get_local_fp32_param(slot.param)[:b - a]
        if not self._has_state(slot):
            return None
        return safe_get_local_optimizer_state(slot.param, kind)[:b - a]

    def held(self, slot):
        from deepspeed.utils import safe_get_local_fp32_param
        a, b = slot.need
        return safe_get_local_fp32_param(slot.param).data.view(-1)[:b - a]

    def write(self, slot, kind, values):
        from deepspeed.utils import (safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                     safe_set_local_fp32_param, safe_set_local_optimizer_state)
        a, b = slot.need
        p = slot.param
        if not slot.trainable:
            internals.local_partition(p).data[:b - a].copy_(values)
            return
        # The setters take the whole (padded) local partition; keep the padding as it is.
        if kind == "param":
            local = safe_get_local_fp32_param(p).clone()
            local[:b - a] = values.to(local.device)
            safe_set_local_fp32_param(p, local)
        else:
            local = safe_get_local_optimizer_state(p, kind).clone()
            local[:b - a] = values.to(local.device)
            safe_set_local_optimizer_state(p, local, kind)

    def _state(self, slot):
        return self.opt.optimizer.state.get(internals.fp32_sub_groups(self.opt)[self.sub_group[id(slot.param)]])

    def begin_load(self):
        internals.partition_all(self.opt)  # every parameter partitioned, as DeepSpeed's own load does

    def prepare_moments(self):
        base = self.opt.optimizer
        for flat in internals.fp32_sub_groups(self.opt):
            if not base.state.get(flat):
                base.state[flat] = new_adam_state(base, flat)

    def finish_load(self):
        # fp32 partitions -> low-precision partitions (what a step does), then re-gather the
        # parameters ZeRO-3 keeps whole ("persistent": smaller than the persistence threshold).
        internals.refresh_lp_partitions(self.opt)

    def full_param(self, slot):
        if slot.trainable:
            from deepspeed.utils import safe_get_full_fp32_param
            return safe_get_full_fp32_param(slot.param).float().cpu().reshape(slot.shape)
        import deepspeed
        with deepspeed.zero.GatheredParameters([slot.param]):
            return slot.param.detach().float().cpu().reshape(slot.shape).clone()


def for_zero12(raw_model, opt, rank: int, world: int) -> Holder:
    """ZeRO-0/1/2's holder, by the optimizer class DeepSpeed chose for the stage and precision."""
    if internals.has_fp32_partitions(opt):
        return FragmentHolder(raw_model, opt, rank, world)
    if internals.has_master_copies(opt):
        return MasterCopyHolder(raw_model, opt, rank, world)
    return ReplicaHolder(raw_model, opt, rank, world)  # ZeRO-0 fp32: the torch optimizer itself
