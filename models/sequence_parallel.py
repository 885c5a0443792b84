"""Ulysses sequence parallelism, the model side (issue 29): the two all-to-alls around attention.

Each rank of a sequence-parallel (SP) group of N ranks holds a contiguous 1/N of every sequence.
Everything but attention is per token, so it runs on the local slice unchanged. Attention needs
the whole sequence: before it, one all-to-all trades sequence for heads (each rank then holds
the full sequence for H/N query heads and K/N key/value heads); after it, the inverse all-to-all
trades them back. Both use `all_to_all_single` on dimension 0 (gloo has it; list-form
`all_to_all` it has not), and each is the other's gradient, so autograd sends every gradient
back to the rank that produced the activation.

GQA: rank j takes query heads [jH/N, (j+1)H/N) and kv heads [jK/N, (j+1)K/N); query head h
reads kv head h // (H/K) in both the full and the split layout, so SDPA's grouping is unchanged
(H and K must both divide by N: train/launch/sequence_parallel.py checks it up front).

Nothing here touches parameters or the checkpoint layout: a model with SP attached holds exactly
the weights of the same model without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SeqParallel:
    """This rank's place in its SP group: `group` (a torch process group of `size` ranks) and
    `rank` within it (which contiguous slice of each sequence this rank holds)."""
    group: Any
    size: int
    rank: int


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dimension 0 (size N chunks): chunk i goes to rank i of the group.
    The exchange is its own adjoint: the gradient takes the same route back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """(B, T/N, h, Hd) local slice, all heads -> (B, T, h/N, Hd) full sequence, this rank's heads."""
    B, t, h, d = x.shape
    n = sp.size
    x = x.reshape(B, t, n, h // n, d).permute(2, 0, 1, 3, 4)          # (N, B, T/N, h/N, Hd): chunk i -> rank i
    y = _AllToAll.apply(x, sp.group)                                  # chunk i <- rank i's slice i
    return y.permute(1, 0, 2, 3, 4).reshape(B, n * t, h // n, d)      # slices in sequence order


def heads_to_seq(y: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """(B, T, h/N, Hd) full sequence, this rank's heads -> (B, T/N, h, Hd) local slice, all heads."""
    B, T, hl, d = y.shape
    n = sp.size
    y = y.reshape(B, n, T // n, hl, d).permute(1, 0, 2, 3, 4)         # (N, B, T/N, h/N, Hd): slice i -> rank i
    x = _AllToAll.apply(y, sp.group)                                  # chunk i <- rank i's heads
    return x.permute(1, 2, 0, 3, 4).reshape(B, T // n, n * hl, d)     # heads in order


def attach(model: torch.nn.Module, sp: SeqParallel | None) -> int:
    """Give every module that supports SP (the GPT and its attention layers: a `seq_parallel`
    attribute) this rank's group; None detaches. Returns the number of modules attached."""
    n = 0
    for m in model.modules():
        if hasattr(m, "seq_parallel"):
            m.seq_parallel = sp
            n += 1
    return n


__all__ = ["SeqParallel", "attach", "heads_to_seq", "seq_to_heads"]
