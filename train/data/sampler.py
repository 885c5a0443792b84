"""A deterministic, resumable batch sampler whose order does not depend on world size.

It yields *global* micro-batches (world x micro indices); Accelerate (split_batches=True)
gives each rank its own contiguous slice. Global optimizer step s therefore always sees
samples perm[s*G : (s+1)*G] of the epoch's permutation (G = global batch), whatever the
number of processes or the accumulation split, which is what lets a checkpoint taken on
N processes resume on M with the same data order. Position = (epoch, samples consumed).

The permutation is torch.randperm up to train/data/permutation.py's SMALL samples and a
Feistel permutation computed per batch above it, so a corpus of any size costs no memory
for its order (a materialised one is 8 bytes per sample on every rank).
"""

from __future__ import annotations

import numpy as np
import torch

from zerotrain.train.data.permutation import SMALL, FeistelPermutation
from zerotrain.train.errors import DataError


class GlobalBatchSampler:
    def __init__(self, num_samples: int, micro: int, world: int, accum: int, seed: int, shuffle: bool = True,
                 what: str = "training set", tag_epoch: bool = False):
        self.num_samples = num_samples
        self.tag_epoch = tag_epoch  # yield epoch * num_samples + index (DataBundle.epoch_tagged)
        self.batch_size = micro * world          # read by Accelerate's BatchSamplerShard
        self.drop_last = True
        self.global_batch = micro * world * accum
        self.seed, self.shuffle = seed, shuffle
        self.steps_per_epoch = num_samples // self.global_batch
        if self.steps_per_epoch == 0:
            raise DataError(f"the {what} has {num_samples} samples, fewer than one global batch of "
                            f"{self.global_batch} (micro {micro} x accum {accum} x world {world}); "
                            f"use more data or a smaller batch")
        self.epoch, self.offset = 0, 0

    # No `set_epoch`: Accelerate calls it with its own iteration counter on every iter().
    def set_position(self, epoch: int, offset: int):
        if offset % self.global_batch or offset >= self.steps_per_epoch * self.global_batch:
            raise ValueError(f"data offset {offset} is not a step boundary of this epoch")
        self.epoch, self.offset = epoch, offset

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order (all of it, including the tail dropped to whole steps);
        materialised, so for tests and small sets: the loop reads slices (slicer)."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        if self.num_samples > SMALL:
            return torch.from_numpy(self._feistel(epoch)(np.arange(self.num_samples)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def _feistel(self, epoch: int) -> FeistelPermutation:
        return FeistelPermutation(self.num_samples, [self.seed % (1 << 64), epoch])

    def slicer(self, epoch: int):
        """(start, stop) -> that slice of the epoch's order, as a list of indices."""
        if self.shuffle and self.num_samples > SMALL:
            perm = self._feistel(epoch)
            return lambda a, b: perm(np.arange(a, b)).tolist()
        order = self.order(epoch)
        return lambda a, b: order[a:b].tolist()

    def __iter__(self):
        take = self.slicer(self.epoch)
        base = self.epoch * self.num_samples if self.tag_epoch else 0
        for start in range(self.offset, self.steps_per_epoch * self.global_batch, self.batch_size):
            batch = take(start, start + self.batch_size)
            yield [base + i for i in batch] if base else batch

    def __len__(self) -> int:
        return (self.steps_per_epoch * self.global_batch - self.offset) // self.batch_size


class EvalBatchSampler:
    """Sequential global batches over the validation set; the last may be short (Accelerate
    pads it evenly and `gather_for_metrics` drops the padding, so no sample counts twice)."""

    def __init__(self, num_samples: int, micro: int, world: int):
        self.batch_size = micro * world
        self.drop_last = False
        self.num_samples = num_samples

    def __iter__(self):
        for start in range(0, self.num_samples, self.batch_size):
            yield list(range(start, min(start + self.batch_size, self.num_samples)))

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)
