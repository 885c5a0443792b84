"""fp16 loss scale: one accessor for every optimizer that can hold one.

DeepSpeed gives fp16 runs different optimizer classes by stage, and they keep the scaler's
state in different places (train/strategy/internals.py `loss_scaler` reads them). Every one of
them has the `loss_scale` property; only the ZeRO ones have `cur_scale` and `loss_scaler`
(reading those crashed ZeRO-0 fp16 at its first log). DDP uses torch's GradScaler.
"""

from __future__ import annotations

from typing import Union

import torch

import zerotrain.train.strategy.internals as internals


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
