"""What a dataset builder returns: the splits plus what the model and the trainer need to know."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from torch.utils.data import Dataset


@dataclass
class DataBundle:
    train: Dataset
    val: Optional[Dataset]
    task: str                               # "lm" | "classify" | "regress"
    describe: str
    items_per_sample: int = 1               # tokens per sample for LMs (throughput), else 1
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    num_classes: Optional[int] = None
    class_names: Optional[list[str]] = None
    num_features: Optional[int] = None
    decode: Optional[Callable] = None       # token ids -> text, for samples
    # LM labels hold the ignore index (-100: prompts, padding), so micro-batches differ in labelled
    # tokens: the trainer divides each optimizer step's summed loss by its global token count.
    masked_labels: bool = False
    extra: dict = field(default_factory=dict)
    # The training split's __getitem__ takes epoch * len(train) + index (GlobalBatchSampler's
    # tag_epoch): per-sample random augmentation seeded by (seed, epoch, index), not by the rank.
    epoch_tagged: bool = False
    # data.sources: the MixturePlan (train/data/mixture.py) behind `train`; the trainer counts
    # each step's samples per source with it, build.py makes its MixtureSampler.
    mixture: Optional[object] = None
    # data.kind stream: the StreamWindows behind `train` (train/data/stream/dataset.py); build.py makes its
    # StreamSampler and hands it the resumed cursor, the trainer saves its cursor with each step.
    stream: Optional[object] = None
