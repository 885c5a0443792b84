"""The run's torch DataLoaders: training batches from the global batch sampler (the same order for
any world size; replicated across a sequence-parallel group), validation over a real subset, and
instruction data padded per batch (data.pad_to longest) where the model allows it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch.utils.data import DataLoader, Subset

from zerotrain.train.config import RunConfig
from zerotrain.train.data.sampler import EvalBatchSampler
from zerotrain.train.launch import sequence_parallel as sp_
from zerotrain.train.training import hardware

if TYPE_CHECKING:
    from zerotrain.models.workload import Workload
    from zerotrain.train.config import Batch
    from zerotrain.train.data.bundle import DataBundle


@dataclass
class Loaders:
    train: DataLoader
    val: Optional[DataLoader]   # None: no validation split
    workers: int                # loader worker processes per rank
    pad_to: Optional[str] = None  # instruction data: "longest" or "seq_len", what the batches use


def build_loaders(cfg: RunConfig, sampler, bundle: DataBundle, b: Batch, world: int, local_world: int, sp_size: int,
                  cuda: bool, workload: Optional[Workload]) -> Loaders:
    """The loaders of `bundle` over `sampler` (micro-batches `b`, `world` processes, `local_world`
    on this node). `workload`: the built model, which decides whether instruction data may be
    padded per batch (None: it may)."""
    workers = hardware.data_workers(cfg.data, local_world)
    batches = sp_.ReplicatedBatches(sampler, sp_size, b.micro) if sp_size > 1 else sampler
    train_set, val_set, collate, pad_to = _padded_sets(cfg, bundle, sp_size, workload)
    train = DataLoader(train_set, batch_sampler=batches, generator=torch.Generator().manual_seed(cfg.train.seed),
                       collate_fn=collate, **hardware.loader_options(workers, b.accum, cuda, train=True))
    val = None  # train.eval_batches 0: evaluation off, no loader (Evaluator.run then returns {})
    if val_set is not None and len(val_set) > 0 and cfg.train.eval_batches != 0:
        subset = val_set
        if cfg.train.eval_batches is not None:
            # A real subset (not just fewer batches) so that Accelerate's end-of-set padding
            # arithmetic in gather_for_metrics sees the true number of samples.
            subset = Subset(subset, range(min(len(subset), cfg.train.eval_batches * b.micro * world)))
        val = DataLoader(subset, batch_sampler=EvalBatchSampler(len(subset), b.micro, world), collate_fn=collate,
                         **hardware.loader_options(workers, 1, cuda, train=False))
    return Loaders(train=train, val=val, workers=workers, pad_to=pad_to)


def _padded_sets(cfg: RunConfig, bundle: DataBundle, sp_size: int, workload: Optional[Workload]):
    """(training set, validation set, collate_fn, pad_to): with data.pad_to longest, instruction
    data and preference pairs padded to each batch's longest sample, unless the run needs one length
    (train/data/sft.py fixed_length_reason: then padded to seq_len, and the banner's data line
    says why)."""
    # data.kind py: the factory's own collate_fn (None: torch's default_collate)
    train_set, val_set, collate, pad_to = bundle.train, bundle.val, bundle.extra.get("collate"), bundle.extra.get("pad_to")
    if pad_to == "longest":
        from zerotrain.train.data import sft
        w = workload
        fixed = sft.fixed_length_reason(sp_size, cfg.hardware.compile, w is not None and w.moe is not None,
                                        w is not None and bool(w.model_loss))
        if fixed is None:
            if bundle.extra.get("preference"):  # pairs: chosen and rejected rows padded to one length
                from zerotrain.train.data.preference import LongestPairs as view
            else:
                view = sft.LongestPadding
            train_set = view(bundle.train)
            val_set = view(bundle.val) if bundle.val is not None else None
            collate = train_set.collate
        else:  # the banner's data line says so
            pad_to = "seq_len"
            bundle.describe = bundle.describe.replace(bundle.extra["layout"], f"padded to {bundle.seq_len} ({fixed})")
    return train_set, val_set, collate, pad_to
