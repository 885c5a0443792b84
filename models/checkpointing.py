"""Activation checkpointing for modules that do not have their own switch (torchvision).

Each chosen unit (a residual block, a transformer layer, a stage) keeps only its input during
the forward pass and runs again during the backward pass. The unit is called *inside* the
checkpoint, hooks included (as transformers' GradientCheckpointingLayer does): under ZeRO-3
the recomputation gathers the unit's parameters again, its own included.

Non-reentrant (torch.utils.checkpoint use_reentrant=False): gradients reach parameters even
when the unit's input needs none (frozen layers before it), and keyword arguments work.

BatchNorm in training mode updates its running statistics in every forward, so a recomputed
unit would apply the momentum update twice: during the recomputation the statistics are left
alone (the batch statistics it normalises with are the same).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


@contextlib.contextmanager
def _statistics_frozen(norms: list):
    """BatchNorm forwards that leave the running statistics as they are: momentum 0 (the
    update becomes running * 1 + batch * 0) and the batch counter put back. Unlike switching
    track_running_stats off, this saves the same tensors for backward as the first forward."""
    saved = [(m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
             for m in norms]
    for m in norms:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, (momentum, count) in zip(norms, saved):
            m.momentum = momentum
            if count is not None:
                m.num_batches_tracked.copy_(count)


def _checkpointed_call(self, *args, **kwargs):
    cls = type(self).__mro__[1]         # the module's own class (ours is a thin subclass of it)
    if not (self.training and torch.is_grad_enabled()):
        return cls.__call__(self, *args, **kwargs)
    norms = [m for m in self.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    return checkpoint(functools.partial(cls.__call__, self, **kwargs), *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), _statistics_frozen(norms)))


_SUBCLASSES: dict = {}


def checkpoint_modules(units: list[nn.Module]) -> int:
    """Make each module recompute its forward in backward. Parameter names, state dicts and
    isinstance() are unchanged (the instance gets a subclass of its own class that only
    overrides __call__). Returns how many modules were changed."""
    n = 0
    for m in units:
        cls = type(m)
        if cls.__name__.startswith("Checkpointed"):
            continue
        if cls not in _SUBCLASSES:
            _SUBCLASSES[cls] = type(f"Checkpointed{cls.__name__}", (cls,), {"__call__": _checkpointed_call,
                                                                             "__module__": cls.__module__})
        m.__class__ = _SUBCLASSES[cls]
        n += 1
    return n
