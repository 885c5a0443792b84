"""The hook through which a backend that partitions parameters as they are created (ZeRO-3's
zero.Init) lets the model builders work on them: models/ imports no backend. The strategy gives
it as its `init_context` (train/strategy/zero.py ZeroInit); a backend without partitioning gives
a plain context factory (contextlib.nullcontext), and the builders then have nothing to gather."""

from __future__ import annotations


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


def hook_of(init_context):
    """The PartitionedInit a builder was given, or None (an ordinary construction)."""
    return init_context if isinstance(init_context, PartitionedInit) else None
