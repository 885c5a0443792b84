"""Plain PyTorch DDP (a ds_configs JSON with a "ddp" block): Accelerate's DDP wrapper, torch's
fused AdamW, and torch's GradScaler under fp16."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

import zerotrain.train.strategy.cost as cost
import zerotrain.train.strategy.ds_config as ds_config
import zerotrain.train.strategy.loss_scale as loss_scale
import zerotrain.train.strategy.registry as registry
from zerotrain.train import testhooks
from zerotrain.train.errors import ConfigError, did_you_mean
from zerotrain.train.strategy.base import Strategy
from zerotrain.train.strategy.option import Option

# Strategy.malloc_figures, from the cgroup peaks of BENCHMARKS.md "Host allocator on CPU".
GLIBC_GROWTH, COMPACT_COST = 1.02, 1.01
#: the "ddp" block's keys: torch DistributedDataParallel's options
DDP_KEYS = ("find_unused_parameters", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "broadcast_buffers")
DDP_BUCKET_CAP_MB = 25        # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class DDPSettings(registry.Settings):
    """What plain DDP alone reads from a strategy file: its "ddp" block and, under fp16, the loss
    scaler's arguments ("fp16" block). Made by `setup` (a run) and `_option` (the planner)."""

    #: the "ddp" block: torch DistributedDataParallel's options (DDP_KEYS), as Accelerate's
    #: DistributedDataParallelKwargs receives them
    ddp_kwargs: dict = field(default_factory=dict)
    #: fp16: torch GradScaler's arguments from the file's "fp16" block (loss_scale.grad_scaler_args); None:
    #: no loss scaling (bf16, fp32; and a planner's option, which prices no scaler)
    grad_scaler: Optional[dict] = None

    @property
    def bucket_view(self) -> bool:
        """gradient_as_bucket_view: gradients are views into DDP's buckets (no second copy)."""
        return bool(self.ddp_kwargs.get("gradient_as_bucket_view", False))

    @property
    def bucket_cap_mb(self) -> float:
        """The size of one gradient bucket, MiB (torch's default when the block does not say)."""
        return float(self.ddp_kwargs.get("bucket_cap_mb", DDP_BUCKET_CAP_MB))


# ------------------------------------------------------------------ the file's block
def setup(path, ds: dict, precision: str, hidden_size: Optional[int] = None, sizes_later: bool = False):
    """A "ddp" file: plain DDP with the block's options (and no DeepSpeed key). `hidden_size` and
    `sizes_later` are the registry's setup arguments (DDP has no "auto" sizes)."""
    stray = [k for k in ds_config.DEEPSPEED_ONLY if k in ds]
    if stray:
        raise ConfigError(f'{path}: a "ddp" file (plain DDP) cannot also set {", ".join(stray)}; '
                          f"use a ds_configs/zero*.json file for DeepSpeed")
    ddp = ds["ddp"]
    if not isinstance(ddp, dict):
        raise ConfigError(f'{path}: "ddp" must be an object of DDP options')
    for k in ddp:
        if k not in DDP_KEYS:
            raise ConfigError(f'{path}: "ddp.{k}" is not a DDP option{did_you_mean(k, DDP_KEYS)}; '
                              f"valid: {', '.join(DDP_KEYS)}")
    settings = DDPSettings(ddp_kwargs=dict(ddp),
                           grad_scaler=loss_scale.grad_scaler_args(path, ds["fp16"]) if precision == "fp16" else None)
    return ds_config.DSSetup(path=str(path), backend="ddp", precision=precision, settings=settings, resolved=ds)


def describe(ds) -> str:
    return f"DDP ({ds.precision})"


class DDPStrategy(Strategy):
    backend = "ddp"

    # ------------------------------------------------------------------ checks and build
    def check_sequence_parallel(self, flag: str) -> None:
        raise ConfigError(f"{flag} needs a ZeRO DeepSpeed JSON, not plain DDP ({self.path}); use e.g. "
                          f"--ds-config ds_configs/zero3.json or set distributed.sequence_parallel 1")

    def build_accelerator(self, batch, timeout_s: int):
        from accelerate.utils import DistributedDataParallelKwargs, GradScalerKwargs

        from zerotrain.train.launch.distributed import build_accelerator
        settings = self.ds.settings
        self.ddp_handler = DistributedDataParallelKwargs(**settings.ddp_kwargs)
        handlers = [self.ddp_handler]
        if settings.grad_scaler:  # fp16: the JSON's loss-scale settings (grad_scaler_args)
            handlers.append(GradScalerKwargs(**settings.grad_scaler))
        return build_accelerator(self.ds.accelerate_mixed_precision, batch, timeout_s, tuple(handlers),
                                 cpu=not torch.cuda.is_available())

    def expect_unused_parameters(self, why: str):
        """DDP waits for every parameter's gradient and fails mid-run when one never comes, unless
        find_unused_parameters is on: set here (Accelerate reads its DDP options at prepare). It
        costs DDP one walk of the autograd graph per step."""
        if self.ddp_handler.find_unused_parameters:
            return None
        self.ddp_handler.find_unused_parameters = True
        return f"ddp.find_unused_parameters set to true: {why}, and DDP would wait for their gradients"

    def build_optimizer(self, model, optim_cfg):
        from zerotrain.train.optim.optimizer import adamw
        # The fused kernel (CUDA and CPU), which also skips a non-finite step on the device
        # (found_inf, set by step() or the GradScaler) without a host sync.
        return adamw(model, optim_cfg, fused=True)

    # ------------------------------------------------------------------ one step
    def backward(self, loss) -> None:
        if testhooks.fire("plant_loss_accum_twice", world=self.acc.num_processes):  # zerotrain verify's tests
            loss = loss / self.acc.gradient_accumulation_steps
        super().backward(loss)

    def step(self, clip: float):
        if testhooks.fire("plant_skip_clip", world=self.acc.num_processes):  # zerotrain verify's tests
            clip = 0.0
        norm = self.acc.clip_grad_norm_(self.engine.parameters(), clip if clip > 0 else float("inf"))
        # A non-finite global norm is the same on every rank (gradients are all-reduced first),
        # so every rank skips together, decided on the device: the fused AdamW
        # (train/optim/optimizer.py) applies nothing, moments and step count included, when
        # found_inf is 1. Under fp16 the GradScaler sets found_inf itself (it also lowers the scale).
        if norm is not None and self.precision != "fp16":
            self.raw_optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    # ------------------------------------------------------------------ fp16
    def loss_scale(self):
        if self.precision != "fp16":
            return None
        return loss_scale.current(scaler=getattr(self.acc, "scaler", None))

    def state_dict(self) -> dict:
        sc = getattr(self.acc, "scaler", None)
        if self.precision != "fp16" or sc is None:
            return {}
        return {"loss_scaler": {"kind": "torch", **{k: float(v) for k, v in sc.state_dict().items()}}}

    def load_state_dict(self, state: dict, at) -> None:
        s = state.get("loss_scaler")
        if not s or self.precision != "fp16" or s.get("kind") != "torch" or getattr(self.acc, "scaler", None) is None:
            return
        state = {k: v for k, v in s.items() if k != "kind"}
        state["_growth_tracker"] = int(state.get("_growth_tracker", 0))
        state["growth_interval"] = int(state.get("growth_interval", 2000))
        self.acc.scaler.load_state_dict(state)

    # ------------------------------------------------------------------ checkpoints and memory
    def make_holder(self, raw_model, rank: int, world: int):
        from zerotrain.train.strategy.holders import ReplicaHolder
        return ReplicaHolder(raw_model, self.raw_optimizer, rank, world)

    @property
    def malloc_figures(self) -> tuple[float, float]:
        return GLIBC_GROWTH, COMPACT_COST


# ------------------------------------------------------------------ the registry entry
def _option(label: str, path, precision: str, ds: dict, width=None) -> Option:
    """A "ddp" file as the planner prices it: the bucket settings of its block."""
    return Option(label, path, "ddp", precision, DDPSettings(ddp_kwargs=dict(ds["ddp"])))


def _default_option(label: str, fname: str, precision: str) -> Option:
    """torch's defaults, with the gradient view ds_configs/ddp.json turns on."""
    return Option(label, None, "ddp", precision, DDPSettings(ddp_kwargs={"gradient_as_bucket_view": True}))


registry.register(registry.Backend(
    name="ddp", block="ddp", strategy=DDPStrategy, setup=setup, option=_option,
    default_option=_default_option, describe=describe, options=(registry.PlannerOption(0, "DDP", "ddp.json"),),
    cost=cost.ddp, startup=cost.DDP_STARTUP, splits_sequences=False))
