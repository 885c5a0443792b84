"""The hooks through which a backend changes how a model is constructed, so that models/ imports
no backend. The strategy gives one as its `init_context`:

  - PartitionedInit: parameters partitioned as they are created (ZeRO-3's zero.Init,
    train/strategy/zero.py ZeroInit); the builders gather what they must write whole;
  - EmptyInit: parameters and buffers on the meta device, shapes without values (FSDP2 on every
    rank but 0, train/strategy/fsdp2.py: it fills each rank's shards from rank 0's build);
  - a plain context factory (contextlib.nullcontext): an ordinary construction."""

from __future__ import annotations

import torch


class PartitionedInit:
    """Calling it gives the context a model is constructed in, each module's parameters
    partitioned over the ranks as soon as the module exists."""

    def __call__(self):
        raise NotImplementedError

    def partitioned(self, params) -> list:
        """Those of `params` the backend partitioned."""
        raise NotImplementedError

    def needs_gather(self, tensor) -> bool:
        """Is `tensor` a partitioned parameter whose whole value is not on this rank now?"""
        raise NotImplementedError

    def gathered(self, params, modifier_rank=None):
        """A context in which `params` are whole on every rank; with `modifier_rank`, what that
        rank writes into them is partitioned to every rank when it exits."""
        raise NotImplementedError


class EmptyInit:
    """Calling it gives the context a model is constructed in on the meta device: every tensor a
    constructor makes has its shape and dtype and no memory. Whatever the builder loads into it
    (pretrained weights) is not kept: the backend fills every parameter and buffer afterwards."""

    def __call__(self):
        return torch.device("meta")


def builds_empty(init_context) -> bool:
    """Does `init_context` construct on the meta device (EmptyInit)?"""
    return isinstance(init_context, EmptyInit)


def hook_of(init_context):
    """The PartitionedInit a builder was given, or None (an ordinary construction)."""
    return init_context if isinstance(init_context, PartitionedInit) else None
