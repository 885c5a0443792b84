"""fp16 loss scale: one accessor for every optimizer that can hold one.

DeepSpeed gives fp16 runs different optimizer classes by stage, and they keep the scaler's
state in different places (DeepSpeed 0.19):

    ZeRO-1/2/3 (DeepSpeedZeroOptimizer*)      .loss_scaler        (DynamicLossScaler: cur_scale,
                                                                   cur_iter, last_overflow_iter, cur_hysteresis)
    ZeRO-0 (FP16_Optimizer / FP16_UnfusedOptimizer)  .loss_scale_config  (cur_scale, cur_iter, last_overflow_iter)

Every one of them has the `loss_scale` property; only the ZeRO ones have `cur_scale` and
`loss_scaler` (reading those crashed ZeRO-0 fp16 at its first log). DDP uses torch's GradScaler.
"""

from __future__ import annotations

from typing import Union

import torch

SCALER_FIELDS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def _holder(optimizer):
    """The object that keeps a DeepSpeed fp16 optimizer's scaler state."""
    for name in ("loss_scaler", "loss_scale_config"):
        h = getattr(optimizer, name, None)
        if h is not None and hasattr(h, "cur_scale"):
            return h
    raise TypeError(f"{type(optimizer).__name__} keeps no fp16 loss scale zerotrain knows how to read "
                    f"(expected .loss_scaler or .loss_scale_config, DeepSpeed 0.19)")


def current(optimizer=None, scaler=None) -> Union[float, torch.Tensor, None]:
    """The scale now, without a host read: a DeepSpeed fp16 optimizer's as a Python float, a
    GradScaler's as a device tensor (a copy: the scaler changes it in place), None without
    either. train/training/health.py reads it per step and converts at logging intervals."""
    if scaler is not None:
        scale = scaler._get_scale_async()
        return None if scale is None else scale.detach().clone()
    if optimizer is None:
        return None
    value = getattr(optimizer, "loss_scale")
    return float(value() if callable(value) else value)


def state(optimizer) -> dict:
    """What a checkpoint keeps of a DeepSpeed fp16 optimizer's scaler (numbers only)."""
    h = _holder(optimizer)
    return {k: float(getattr(h, k)) for k in SCALER_FIELDS if getattr(h, k, None) is not None}


def restore(optimizer, saved: dict) -> None:
    h = _holder(optimizer)
    for k, v in saved.items():
        if k in SCALER_FIELDS and hasattr(h, k):
            setattr(h, k, float(v) if k == "cur_scale" else int(v))
