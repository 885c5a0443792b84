"""The batch arithmetic: micro-batch x accumulation steps x world size = global batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerotrain.train.errors import ConfigError


@dataclass(frozen=True)
class Batch:
    micro: int
    accum: int
    world: int

    @property
    def global_size(self) -> int:
        return self.micro * self.accum * self.world


def split_batch(micro: int, grad_accum_steps: Optional[int], global_batch_size: Optional[int],
                world_size: int) -> Batch:
    """Resolve micro x accumulation x world = global from train.*, checking divisibility: a
    global batch size fixes the accumulation steps, else they default to 1."""
    if global_batch_size is None:
        return Batch(micro=micro, accum=grad_accum_steps or 1, world=world_size)
    per_step = micro * world_size
    if global_batch_size % per_step:
        raise ConfigError(
            f"train.global_batch_size={global_batch_size} is not divisible by "
            f"train.micro_batch_size x world size = {micro} x {world_size} = {per_step}; "
            f"use a multiple of {per_step} or change the micro-batch")
    accum = global_batch_size // per_step
    if grad_accum_steps is not None and grad_accum_steps != accum:
        raise ConfigError(
            f"train.grad_accum_steps={grad_accum_steps} contradicts train.global_batch_size="
            f"{global_batch_size} (= {micro} x {accum} x {world_size} processes); set only one")
    return Batch(micro=micro, accum=accum, world=world_size)
