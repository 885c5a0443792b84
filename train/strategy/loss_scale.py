"""fp16 loss scale: one accessor for every optimizer that can hold one.

DeepSpeed gives fp16 runs different optimizer classes by stage, and they keep the scaler's
state in different places (train/strategy/internals.py `loss_scaler` reads them). Every one of
them has the `loss_scale` property; only the ZeRO ones have `cur_scale` and `loss_scaler`
(reading those crashed ZeRO-0 fp16 at its first log). DDP uses torch's GradScaler, FSDP2
DynamicScale (GradScaler's rule): both read a strategy file's "fp16" block through
`grad_scaler_args`.
"""

from __future__ import annotations

from typing import Union

import torch

import zerotrain.train.strategy.internals as internals
from zerotrain.train.errors import ConfigError, did_you_mean

# DeepSpeed's fp16 block as torch's GradScaler: the keys that have a meaning there.
GRAD_SCALER_KEYS = {"initial_scale_power": "init_scale = 2**initial_scale_power",
                    "loss_scale_window": "growth_interval"}


def grad_scaler_args(path, fp16: dict, who: str = "DDP's GradScaler") -> dict:
    """GradScaler(init_scale, growth_interval) from a DDP or FSDP2 file's "fp16" block (`who`
    names the scaler in the refusals). DeepSpeed's other knobs have no GradScaler equivalent (it
    lowers the scale at every overflow, has no floor and no static mode): refused unless they ask
    for exactly that behaviour."""
    out = {"init_scale": 2.0 ** 16, "growth_interval": 2000}  # GradScaler's own defaults but init 2**16
    for k, v in fp16.items():
        if k == "enabled":
            continue
        if k == "loss_scale":
            if v not in (0, 0.0):
                raise ConfigError(f'{path}: "fp16.loss_scale": {v!r}: {who} has no static loss scale; '
                                  f'use 0 (dynamic) or a ds_configs/zero*.json file (DeepSpeed supports static scales)')
        elif k == "hysteresis":
            if v != 1:
                raise ConfigError(f'{path}: "fp16.hysteresis": {v!r}: {who} lowers the scale at every '
                                  f"overflow (hysteresis 1); remove the key or use a ds_configs/zero*.json file")
        elif k == "initial_scale_power":
            out["init_scale"] = 2.0 ** int(v)
        elif k == "loss_scale_window":
            out["growth_interval"] = int(v)
        else:
            supported = ["enabled", "loss_scale", "hysteresis", *GRAD_SCALER_KEYS]
            raise ConfigError(f'{path}: "fp16.{k}" has no equivalent in {who}{did_you_mean(k, supported)}; '
                              f"supported: {', '.join(supported)} (min_loss_scale and the rest need a "
                              f"ds_configs/zero*.json file)")
    return out


def current(optimizer=None, scaler=None) -> Union[float, torch.Tensor, None]:
    """The scale now, without a host read: a DeepSpeed fp16 optimizer's as a Python float, a
    GradScaler's as a device tensor (a copy: the scaler changes it in place), None without
    either. train/training/health.py reads it per step and converts at logging intervals."""
    if scaler is not None:
        scale = scaler._get_scale_async()
        return None if scale is None else scale.detach().clone()
    if optimizer is None:
        return None
    return internals.loss_scale(optimizer)


def state(optimizer) -> dict:
    """What a checkpoint keeps of a DeepSpeed fp16 optimizer's scaler (numbers only)."""
    return internals.scaler_fields(internals.loss_scaler(optimizer))


def restore(optimizer, saved: dict) -> None:
    internals.set_scaler_fields(internals.loss_scaler(optimizer), saved)


class DynamicScale:
    """FSDP2's fp16 loss scale: torch GradScaler's rule (train/strategy/ds_config.py
    grad_scaler_args reads the same "fp16" keys), decided on the global gradient norm.

    The scale multiplies the loss before backward; at the step the gradients are divided by it,
    and the step is an overflow when the norm of the unscaled gradients over every shard (a
    DTensor reduction: the same number on every rank) is not finite. An overflow halves the
    scale and the optimizer skips the step (found_inf); `growth_interval` clean steps in a row
    double it. The update is torch's own kernel (torch._amp_update_scale_, GradScaler.update's),
    on the device, without a host read.

    Why not torch's GradScaler through Accelerate (what DDP uses): Accelerate makes none on a CPU,
    so the code the CPU tests run would not be the GPU's; and its unscale_ would check the DTensor
    gradients for inf with a second reduction (DTensor dispatch all-reduces found_inf:
    torch/distributed/tensor/_dispatch.py found_inf_reduce_handler) where the strategy already
    reduces the global norm, which decides the same thing. This reuses that norm, on CPU and GPU
    alike."""

    GROWTH, BACKOFF = 2.0, 0.5

    def __init__(self, device, init_scale: float, growth_interval: int):
        self.growth_interval = int(growth_interval)
        self.scale = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale, in fp32 (an fp16 loss times 2**16 would overflow itself)."""
        return loss.float() * self.scale.to(loss.device)

    def unscale_(self, grads: list) -> None:
        """Every gradient divided by the scale (exact: a power of two), in place."""
        if grads:
            torch._foreach_mul_(grads, self.scale.double().reciprocal().float())

    def update(self, found_inf: torch.Tensor) -> None:
        """After the step: halve at an overflow, double after growth_interval clean steps."""
        torch._amp_update_scale_(self.scale, self.growth_tracker, found_inf.to(self.scale.device, torch.float32),
                                 self.GROWTH, self.BACKOFF, self.growth_interval)

    def current(self) -> torch.Tensor:
        return self.scale.detach().clone()

    def state_dict(self) -> dict:
        """GradScaler.state_dict's fields (DDP's record): a checkpoint's scale moves between the two."""
        return {"scale": float(self.scale), "growth_factor": self.GROWTH, "backoff_factor": self.BACKOFF,
                "growth_interval": self.growth_interval, "_growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        """The saved scale and count of clean steps; growth_interval stays the file's
        ("fp16.loss_scale_window" rules), the count capped below it."""
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(min(int(state.get("_growth_tracker", 0)), self.growth_interval - 1))
