"""Weighted mixtures of token files (data.sources): which source, and which of its sequences,
every training sample of every epoch comes from.

An epoch has N samples (N = the sources' sequences together). Source s owns a fixed block of
c_s positions, c_s = its weight's share of N rounded by largest remainder (so the blocks add up
to N exactly), and walks through its own stream of sequences: the concatenation of seeded
permutations of the source ("cycles"), epoch e taking stream items e*c_s .. (e+1)*c_s - 1. So
an up-sampled source (c_s > its size) repeats, each sequence once per cycle; a down-sampled
one sees a fresh part of itself every epoch rather than the same subset.

The order of the epoch is the unchanged GlobalBatchSampler's permutation of the N positions
(MixtureSampler only tags each position with its epoch, index = epoch*N + position), so the
mixture inherits its guarantees: the same global batches for any world size and accumulation,
and resume from (epoch, offset). Everything is a pure function of (seed, epoch, position):
nothing about the mixture needs saving, and any rank can tell host-side, without a device
sync or a collective, how many samples of a step came from each source (step_counts).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import numpy as np
from torch.utils.data import Dataset

from zerotrain.train.config import TokensData
from zerotrain.train.data.bundle import DataBundle
from zerotrain.train.data.permutation import SMALL, FeistelPermutation
from zerotrain.train.data.sampler import GlobalBatchSampler
from zerotrain.train.errors import DataError


def largest_remainder(weights: list[float], total: int) -> list[int]:
    """Integers proportional to `weights` that add up to `total` (Hamilton's method; ties go
    to the earlier source, so the split is deterministic)."""
    w = np.asarray(weights, dtype=np.float64)
    quotas = w / w.sum() * total
    counts = np.floor(quotas).astype(np.int64)
    left = total - int(counts.sum())
    order = sorted(range(len(w)), key=lambda s: (-(quotas[s] - counts[s]), s))
    for s in order[:left]:
        counts[s] += 1
    return counts.tolist()


class MixturePlan:
    """Position -> (source, sequence) for every epoch; see the module docstring."""

    def __init__(self, names: list[str], weights: list[float], lengths: list[int], seed: int,
                 epoch_samples: Optional[int] = None, paths: Optional[list[str]] = None):
        self.names, self.weights, self.lengths, self.seed = list(names), list(weights), list(lengths), seed
        self.epoch_samples = epoch_samples or sum(lengths)
        self.counts = largest_remainder(weights, self.epoch_samples)
        for s, c in enumerate(self.counts):
            if c == 0:
                what = (paths or names)[s]
                raise DataError(f"data.sources {what}: weight {weights[s]:g} gives it no sample in an epoch of "
                                f"{self.epoch_samples}; raise its weight or drop the source")
        self.ends = np.cumsum(self.counts)           # block s = positions [ends[s] - counts[s], ends[s])
        self.starts = self.ends - np.asarray(self.counts)
        # Cycles of source s one epoch touches (its c_s stream items, in random order): all are kept,
        # or a 1 GB source up-sampled 5x in a mixture redraws a 3.7M permutation for most samples.
        self.span = [-(-c // n) + 1 for c, n in zip(self.counts, self.lengths)]
        self._perms: dict[int, dict[int, np.ndarray]] = {}

    def shares(self) -> list[float]:
        return [c / self.epoch_samples for c in self.counts]

    def source_of(self, positions) -> np.ndarray:
        """The source of each position (0..N-1) of an epoch."""
        return np.searchsorted(self.ends, np.asarray(positions), side="right")

    def step_counts(self, positions) -> np.ndarray:
        """Samples per source among `positions` (e.g. one step's global batch)."""
        return np.bincount(self.source_of(positions), minlength=len(self.names))

    def locate(self, epoch: int, position: int) -> tuple[int, int]:
        """(source, index of the sequence in that source) of `position` in `epoch`."""
        s = int(self.source_of(position))
        t = epoch * self.counts[s] + (position - int(self.starts[s]))  # the item of the source's stream
        cycle, k = divmod(t, self.lengths[s])
        return s, int(self._perm(s, cycle)[k])

    def _perm(self, s: int, cycle: int):
        """Cycle `cycle` of source s: a permutation of its sequences, seeded by (seed, s, cycle);
        indexable by k. Materialised while an epoch's cycles of it fit in permutation.SMALL entries
        (every small mixture, unchanged), else a Feistel permutation (no memory, nothing to redraw)."""
        cache = self._perms.setdefault(s, {})
        if cycle not in cache:
            if len(cache) >= max(4, self.span[s]):  # the lowest cycle: an earlier epoch's (inserted in random order)
                cache.pop(min(cache))
            n = self.lengths[s]
            cache[cycle] = FeistelPermutation(n, [self.seed % (1 << 64), s, cycle]) if n * self.span[s] > SMALL \
                else np.random.default_rng([self.seed, s, cycle]).permutation(n)
        return cache[cycle]

    def __getstate__(self):
        # A DataLoader worker started by pickling (spawn) redraws what it needs.
        return {**self.__dict__, "_perms": {}}

    def record(self) -> list[dict]:
        """The plan as config.json and checkpoints record it."""
        return [{"name": n, "weight": w, "sequences": ln, "per_epoch": c}
                for n, w, ln, c in zip(self.names, self.weights, self.lengths, self.counts)]


class MixtureDataset(Dataset):
    """Training samples of a mixture; index = epoch * N + position (MixtureSampler's)."""

    def __init__(self, sources: list[Dataset], plan: MixturePlan):
        self.sources, self.plan = sources, plan

    def __len__(self) -> int:
        return self.plan.epoch_samples

    def __getitem__(self, index: int) -> dict:
        epoch, position = divmod(int(index), self.plan.epoch_samples)
        s, i = self.plan.locate(epoch, position)
        return self.sources[s][i]


class MixtureSampler(GlobalBatchSampler):
    """GlobalBatchSampler's order, each position tagged with its epoch for MixtureDataset."""

    def __init__(self, plan: MixturePlan, micro: int, world: int, accum: int, seed: int):
        super().__init__(plan.epoch_samples, micro, world, accum, seed, what="data.sources mixture")
        self.plan = plan
        self._order: tuple[int, object] = (-1, None)  # the current epoch's order, for step_counts

    def __iter__(self):
        base = self.epoch * self.num_samples
        for batch in super().__iter__():
            yield [base + i for i in batch]

    def step_counts(self, epoch: int, offset: int) -> np.ndarray:
        """Samples per source in the global batch of `epoch` starting at `offset`: host-side
        arithmetic, identical on every rank."""
        if self._order[0] != epoch:
            self._order = (epoch, self.slicer(epoch))
        return self.plan.step_counts(self._order[1](offset, offset + self.global_batch))


class InterleavedVal(Dataset):
    """The sources' validation splits merged in proportion to the weights (stride scheduling:
    item j of source s sorts at (j + 0.5) / weight_s), so any prefix, such as the one
    train.eval_batches evaluates, is the training mixture, until a split runs out."""

    def __init__(self, splits: list[Optional[Dataset]], weights: list[float]):
        self.splits = splits
        keys, src, idx = [], [], []
        for s, (split, w) in enumerate(zip(splits, weights)):
            n = len(split) if split is not None else 0
            keys.append((np.arange(n) + 0.5) / w)
            src.append(np.full(n, s))
            idx.append(np.arange(n))
        keys, src, idx = np.concatenate(keys), np.concatenate(src), np.concatenate(idx)
        order = np.lexsort((src, keys))  # by key, ties by source: deterministic
        self.src, self.idx = src[order], idx[order]

    def __len__(self) -> int:
        return len(self.src)

    def __getitem__(self, i: int) -> dict:
        return self.splits[int(self.src[i])][int(self.idx[i])]


def build_mixture(cfg: TokensData, seq_len: Optional[int], seed: int) -> DataBundle:
    """One DataBundle from data.sources: each file read by build_tokens (checks, val split)."""
    from zerotrain.train.data.tokens import build_tokens
    bundles = []
    for i, src in enumerate(cfg.sources):
        if _is_dataset_file(src.path):
            raise DataError(f"data.sources[{i}] ({src.name}): {src.path} is a parquet/arrow/jsonl file: streamed "
                            f"tokenization (data.kind stream) cannot take part in a mixture; `zerotrain prepare "
                            f"{src.path} --text-field FIELD --out DIR` it first and list DIR here")
        try:
            bundles.append(build_tokens(dataclasses.replace(cfg, sources=[], path=src.path), seq_len))
        except DataError as e:  # its message says data.path: name the source it came from
            raise DataError(f"data.sources[{i}] ({src.name}): {e}") from None
    _check_agree(cfg, bundles)
    plan = MixturePlan([s.name for s in cfg.sources], [s.weight for s in cfg.sources],
                       [len(b.train) for b in bundles], seed, paths=[s.path for s in cfg.sources])
    vals = [b.val if b.val is not None and len(b.val) > 0 else None for b in bundles]
    val = InterleavedVal(vals, plan.weights) if any(v is not None for v in vals) else None
    first = bundles[0]
    parts = ", ".join(f"{n} {share:.1%} ({ln} seq)" for n, share, ln in zip(plan.names, plan.shares(), plan.lengths))
    return DataBundle(train=MixtureDataset([b.train for b in bundles], plan), val=val, task="lm",
                      items_per_sample=seq_len, vocab_size=max(b.vocab_size for b in bundles), seq_len=seq_len,
                      decode=first.decode, mixture=plan,
                      describe=f"mixture of {len(bundles)} token files, {plan.epoch_samples} sequences of {seq_len} "
                               f"per epoch: {parts}" + _masked(cfg, bundles),
                      extra={"max_token": max(b.extra["max_token"] for b in bundles),
                             "token_file": ", ".join(s.path for s in cfg.sources),
                             "tokenizer": first.extra.get("tokenizer"), "mixture": plan.record(),
                             **{k: first.extra[k] for k in ("packed", "eos_id") if k in first.extra}})


def _masked(cfg: TokensData, bundles: list[DataBundle]) -> str:
    """data.document_mask: every source masks at the same EOS id (each source's windows are
    masked by build_tokens); the describe note."""
    if not cfg.document_mask:
        return ""
    ids = [b.extra["eos_id"] for b in bundles]
    for src, eos in zip(cfg.sources[1:], ids[1:]):
        if eos != ids[0]:
            raise DataError(f"data.document_mask: data.sources {cfg.sources[0].path} ends documents with EOS id "
                            f"{ids[0]} but {src.path} with {eos}; prepare them with the same --tokenizer, or set "
                            f"data.eos_id")
    return f"; document-masked at EOS id {ids[0]}"


def _check_agree(cfg: TokensData, bundles: list[DataBundle]):
    """Every source must speak the same tokenizer: a mixture of vocabularies trains garbage."""
    ref, ref_path = bundles[0], cfg.sources[0].path
    for src, b in zip(cfg.sources[1:], bundles[1:]):
        t0, t1 = ref.extra.get("tokenizer"), b.extra.get("tokenizer")
        if t0 is not None and t1 is not None and (t0 != t1 or ref.vocab_size != b.vocab_size):
            raise DataError(f"data.sources {ref_path} and {src.path} were tokenized differently ({t0}, vocab "
                            f"{ref.vocab_size} vs {t1}, vocab {b.vocab_size}); re-run `zerotrain prepare` on "
                            f"both with the same --tokenizer")


def _is_dataset_file(path: str) -> bool:
    from zerotrain.train.data.prep_sources import DATASET_SUFFIXES
    from zerotrain.train.data.shards import MANIFEST
    return Path(path).suffix.lower() in DATASET_SUFFIXES and Path(path).name != MANIFEST
