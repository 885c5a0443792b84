"""What a training backend is to the rest of zerotrain: one object per backend (plain DDP,
DeepSpeed ZeRO 0-3 with offload, FSDP2) owns everything that differs between them, so no other module
asks which one runs (tests/test_structure.py counts the places that still do).

A Strategy is made from the run's resolved DeepSpeed JSON (train/strategy/ds_config.py
`DSSetup`) by `train.strategy.for_setup`, before anything is built. Its life in a run:

    strategy.check_run(cfg)                     the backend's refusals of this run
    acc = strategy.build_accelerator(...)       the Accelerator and the process group
    ctx = strategy.init_context()               how the model is constructed (ZeRO-3: partitioned)
    opt = strategy.build_optimizer(model, ...)  the AdamW this backend steps
    strategy.prepare(acc, model, opt, loaders)  accelerate.prepare; the strategy keeps the engine
    strategy.step(clip) / loss_scale() / ...    per step: clip and step, the fp16 scale
    strategy.make_holder(...)                   what a checkpoint reads and writes: the tensors,
    strategy.state_dict() / load_state_dict()   and the engine's counters and fp16 scaler (the
                                                checkpoint's "engine" component, a Stateful)

The planner's cost model of each backend is train/strategy/cost.py; the DeepSpeed private
attributes the project reads are train/strategy/internals.py.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Optional

import torch

from zerotrain.train.errors import ConfigError

if TYPE_CHECKING:
    from zerotrain.train.strategy.ds_config import DSSetup


class Strategy:
    """The interface, with what the backends share. Subclasses: DDPStrategy (ddp.py), ZeroStrategy
    (zero.py) and FSDP2Strategy (fsdp2.py)."""

    #: "ddp" | "deepspeed" | "fsdp2": the name a checkpoint and config.json record
    backend: str = ""

    def __init__(self, ds: DSSetup):
        self.ds = ds
        # Set by prepare(): the Accelerator, what it prepared, and the torch optimizer inside.
        self.acc = None
        self.engine: Optional[torch.nn.Module] = None     # a DeepSpeed engine, a DDP wrapper or the module
        self.optimizer = None                             # accelerate's optimizer wrapper
        self.raw_optimizer: Optional[torch.optim.Optimizer] = None

    # ------------------------------------------------------------------ what it is
    @property
    def precision(self) -> str:
        return self.ds.precision

    @property
    def path(self) -> str:
        return self.ds.path

    def describe(self) -> str:
        """One phrase for banners and errors, e.g. "ZeRO-2 (bf16)" (the JSON's own description)."""
        return self.ds.describe()

    def record(self) -> dict:
        """What a checkpoint's meta.json and config.json say of the strategy."""
        return {"backend": self.backend, "zero_stage": None, "precision": self.precision}

    @property
    def partitions_parameters(self) -> bool:
        """Parameters split over the ranks (ZeRO-3): the model must be built partitioned, and
        reading a whole parameter is a gather."""
        return False

    # ------------------------------------------------------------------ checks and build
    def check_run(self, cfg) -> None:
        """Refuses, in one line, what this backend cannot run (raises ConfigError)."""
        # `accelerate launch` exports the YAML's mixed_precision; it must agree with the JSON.
        mp = os.environ.get("ACCELERATE_MIXED_PRECISION")
        if mp and mp != "no" and mp != self.ds.accelerate_mixed_precision:
            raise ConfigError(f"the accelerate config sets mixed_precision: {mp} but {self.path} selects "
                              f"{self.precision}; precision comes from the DeepSpeed JSON: remove mixed_precision "
                              f"from the accelerate YAML or make them agree")

    def check_sequence_parallel(self, flag: str) -> None:
        """Refuses distributed.sequence_parallel (`flag`) where the backend cannot split sequences."""

    def check_channels_last(self, cfg, want: Optional[bool], family: str, cuda: bool) -> bool:
        """model.channels_last resolved: None means vision models on a GPU where the backend keeps
        the layout."""
        if want is None:
            return family == "vision" and cuda
        return bool(want)

    def check_frozen_copy(self, what: str) -> None:
        """Refuses `what` (DPO's reference of full fine-tuning) where the backend cannot copy the
        model whole and frozen."""

    def build_accelerator(self, batch, timeout_s: int):
        raise NotImplementedError

    def make_leaf_modules(self, model: torch.nn.Module, classes) -> bool:
        """Makes the modules of `classes` (sparse-MoE blocks: models/moe.py MoEInfo) units the
        backend gathers whole, before the engine hooks the model; True where it did. Only a
        backend that partitions parameters has anything to do."""
        return False

    def expect_unused_parameters(self, why: str) -> Optional[str]:
        """Prepares the backend for parameters that get no gradient on some rank in a step (`why`:
        a sparse MoE's experts its tokens did not reach), before the model is prepared; returns a
        start-up line saying what changed, or None. ZeRO reduces every partition and FSDP2 every
        unit whatever their gradients: nothing to do there."""
        return None

    def init_context(self):
        """A zero-argument callable giving the context the model is constructed in."""
        return contextlib.nullcontext

    def build_optimizer(self, model: torch.nn.Module, optim_cfg):
        raise NotImplementedError

    def prepare(self, acc, model, raw_optimizer, *loaders):
        """accelerate.prepare(model, optimizer, loaders...); keeps the engine and optimizers.
        Returns the prepared loaders."""
        self.acc, self.raw_optimizer = acc, raw_optimizer
        self.engine, self.optimizer, *prepared = acc.prepare(model, raw_optimizer, *loaders)
        return prepared

    def after_prepare(self, workload) -> dict:
        """Adjusts the prepared model where the backend needs it; returns facts for this rank's
        ranks/rank<R>.json."""
        return {}

    def place_frozen_copy(self, module: torch.nn.Module, device) -> torch.nn.Module:
        """DPO's frozen copy of the model as built (models/preference.py frozen_copy), before the
        model is prepared, put on `device` with the values every rank starts from."""
        return module.to(device)

    def frozen_like_policy(self, module: torch.nn.Module) -> torch.nn.Module:
        """A frozen module run beside the model (DPO's reference: the live copy, built before
        prepare, or `zerotrain prepare --reference`'s model), made to compute as the model does at
        step 1: under Accelerate's mixed precision (DDP bf16/fp16) its forward gets the autocast
        and fp32 outputs Accelerate gives the model's (torch.autocast on the module's device in the
        precision's dtype: build_accelerator passes no AutocastKwargs), so that the policy and the
        reference give the same log-probs bit for bit (the rewards exactly 0, the DPO loss exactly
        log 2). It reads only the strategy file, never the Accelerator, engine or process group:
        prepare runs it in a plain process. Call it once the module is on its device. Returns the module."""
        dtype = HALF_DTYPES.get(self.precision)
        if dtype is None:
            return module
        from types import MethodType

        from accelerate.utils import convert_outputs_to_fp32
        device = next(module.parameters()).device
        forward = module.forward.__func__ if hasattr(module.forward, "__func__") else module.forward
        module.forward = MethodType(convert_outputs_to_fp32(torch.autocast(device.type, dtype=dtype)(forward)), module)
        return module

    def compute_form(self, device_type: str) -> str:
        """How frozen_like_policy makes a module compute on `device_type` ("cuda", "cpu"), in words
        that differ wherever two runs' log-probs of the same weights can: what a precomputed DPO
        reference file records (train/data/reference.py) so that a run computing otherwise
        refuses it. fp32 is "fp32" under every backend and device (the files made before the form
        was recorded were fp32)."""
        if self.precision == "fp32":
            return "fp32"
        return f"{self.precision} autocast with fp32 outputs ({self.backend}) on {device_type}"

    # ------------------------------------------------------------------ one step
    def input_dtype(self) -> Optional[torch.dtype]:
        """The dtype float inputs are cast to (the parameters' own when they are 16-bit); None: keep."""
        return None

    def backward(self, loss) -> None:
        """One micro-batch's backward: Accelerate's, which divides by the accumulation under DDP
        (DeepSpeed's engine.backward divides, and at the boundary clips and steps, itself)."""
        self.acc.backward(loss)

    def step(self, clip: float):
        """At the accumulation boundary, after backward: clip, step and zero the gradients.
        Returns the global gradient norm (a device tensor or a float, read later by Health), or
        None. Every backend returns the same quantity: the L2 norm, before clipping, of the
        gradient averaged over every rank and micro-batch, over all trainable parameters, the
        same on every rank (DDP: clip_grad_norm_ of the all-reduced gradients; ZeRO: the norm
        DeepSpeed computed over the reduced partitions). Each engine still computes it itself."""
        raise NotImplementedError

    def param_checksum(self, origin: list | None = None) -> tuple[float, float, float]:
        """A checksum of every parameter as the last step left it, the same numbers for the same
        values under every backend and world size (`zerotrain verify` compares them): the
        parameters' projection on a fixed pseudo-random direction w (param_projection), in the
        model's parameter order, and ||w * p||^2, its size were the signs random (a difference
        divided by its square root reads as the typical relative change of one element). Whole
        parameters here; ZeRO-3 gathers each first. Every rank calls it (a collective where the
        backend gathers).

        `origin` (a 1-process run: it holds a host copy of the whole model): an empty list is
        filled with each parameter's fp32 copy now; a filled one gives the third number,
        ||w * (p - origin)||^2, the size of the update since then (verify's scale for comparing
        what the steps changed). 0.0 without it."""
        total, offset = torch.zeros(3, dtype=torch.float64), 0
        for i, p in enumerate(self.engine.parameters()):
            total, offset = total + param_projection(p, offset, _origin_of(origin, i, p)), offset + p.numel()
        return float(total[0]), float(total[1]), float(total[2])

    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups as it holds them before step 1: the names of the
        parameters in each (as train/optim/optimizer.py grouped them), and the hyperparameters
        the optimizer itself holds (lr, betas, eps, weight_decay). `zerotrain verify` compares them."""
        return [{"names": list(g.get("names", ())), "lr": g.get("lr"), "betas": list(g.get("betas", ())),
                 "eps": g.get("eps"), "weight_decay": g.get("weight_decay")}
                for g in self.raw_optimizer.param_groups]

    # ------------------------------------------------------------------ fp16 and counters
    @property
    def loss_scale_floor(self) -> float:
        """The fp16 scale at which an overflowing step can no longer lower it."""
        return 1.0

    def loss_scale(self):
        """The fp16 loss scale now, without a host read; None without fp16."""
        return None

    def counts_skipped_steps(self) -> bool:
        """True when the engine counts its own skipped fp16 steps (engine_skipped_steps)."""
        return False

    def engine_skipped_steps(self) -> Optional[int]:
        return None

    def state_dict(self) -> dict:
        """The engine's non-tensor state a checkpoint keeps (train/checkpoint/state.py Stateful):
        {"counters": the step counters, "loss_scaler": the fp16 scaler}, each where the backend has it."""
        return {}

    def load_state_dict(self, state: dict, at) -> None:
        """Sets the engine's state from state_dict()'s record; what the record lacks (a checkpoint
        of another backend) follows from the TrainState `at` the run resumes at."""

    # ------------------------------------------------------------------ checkpoints and memory
    def make_holder(self, raw_model, rank: int, world: int):
        """The object that reads and writes this rank's parameters and optimizer moments."""
        raise NotImplementedError

    def uses_shm_buffers(self) -> bool:
        """Has this backend's communication mapped the /dev/shm buffers that
        train/launch/shm_buffers.py releases (DeepSpeed's CPU all-reduce)? Asked once the engine
        exists."""
        return False

    def step_target(self):
        """The optimizer object whose step() the memory probe hooks."""
        return self.raw_optimizer

    def measure_model_states(self, model, raw_optimizer):
        """The model-state bytes this rank holds now (train/observe/memory.py ModelStateBytes):
        the memory probe's measurement. state_bytes.py reads every engine DDP and DeepSpeed give."""
        from zerotrain.train.strategy.state_bytes import measure
        return measure(model, raw_optimizer)

    @property
    def malloc_figures(self) -> tuple[float, float]:
        """(glibc growth, compact cost) of this backend on a CPU, what train/launch/host_settings.py
        decides with: a rank's peak with glibc's default malloc over its peak with compact malloc,
        and compact malloc's step time over glibc's (measured: BENCHMARKS.md "Host allocator on
        CPU", fp32, 2 ranks, huge pages off)."""
        raise NotImplementedError


#: the 16-bit precisions' dtypes (a strategy file's "bf16"/"fp16"): what the frozen reference computes in
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

_GOLDEN = 0.6180339887498949  # the direction's frequency: irrational, so no two elements share a weight pattern


def param_projection(p: torch.Tensor, offset: int, origin: torch.Tensor | None = None) -> torch.Tensor:
    """[sum_i w_i p_i, sum_i (w_i p_i)^2, sum_i (w_i (p_i - origin_i))^2] in float64, p flattened,
    w_i = cos((offset + i) x golden ratio): element i of the whole model (offset: the elements of
    the parameters before p) always gets the same weight, so a change to any element moves the
    sum, and a symmetric update cannot cancel out the way it would in a plain sum. The third: 0
    without `origin`."""
    flat = p.detach().reshape(-1).to(torch.float64)
    idx = torch.arange(offset, offset + flat.numel(), dtype=torch.float64, device=flat.device)
    w = torch.cos(idx * _GOLDEN)
    weighted = flat * w
    moved = ((flat - origin.to(flat.device, torch.float64)) * w).square().sum() if origin is not None \
        else torch.zeros((), dtype=torch.float64, device=flat.device)
    return torch.stack([weighted.sum(), weighted.square().sum(), moved]).cpu()


def _origin_of(origin: list | None, i: int, p: torch.Tensor) -> torch.Tensor | None:
    """Parameter i's copy in `origin` (Strategy.param_checksum); an empty list's first pass copies."""
    if origin is None:
        return None
    if len(origin) <= i:
        origin.append(p.detach().reshape(-1).to("cpu", torch.float32, copy=True))
        return None
    return origin[i]
