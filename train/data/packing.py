"""Packed instruction data (`data.packing: true` for `data.kind: sft`): several records per row.

Records are mostly far shorter than data.seq_len: one record per row spends most of a step on
padding. Packing fills each row of seq_len tokens with whole records, best-fit-decreasing within
consecutive windows of WINDOW records taken in a seeded order of the records:

    records --seeded permutation--> windows of WINDOW --BFD per window--> rows

Best-fit-decreasing: a window's records, longest first, each go into the open row with the
least room that still holds it (a new row if none does). Rows of one window are closed at its
end, so the plan is a pure function of (seed, record lengths, seq_len): nothing to save in a
checkpoint, the same on every rank. The rows are then the samples of the GlobalBatchSampler
(train/data/sampler.py), shuffled per epoch like any other samples: the same global batches for
any world size and accumulation, and exact resume.

A row carries, per token, the document index (doc_ids: which record of the row it belongs to)
and the position inside that record (position_ids, restarting at 0). The models attend only
inside a document and rotate by those positions (models/gpt.py document_mask; hf: position_ids,
models/hf.py), so each record computes exactly what it computes in a row of its own. A record
is truncated to seq_len + 1 tokens exactly as unpacked (its seq_len input/label pairs fill at
most one row). The tail of a row is padding: a document of its own, labels ignored.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.models.losses import IGNORE_INDEX

WINDOW = 1024  # records packed together: larger packs tighter, costs more start-up time


def packed_lengths(offsets: np.ndarray, seq_len: int) -> np.ndarray:
    """Tokens each record occupies in a row: its input/label pairs after truncation to
    seq_len + 1 tokens (a record of n tokens has n - 1 pairs)."""
    return np.minimum(np.diff(offsets), seq_len + 1) - 1


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of indices into `lengths`, each summing to <= capacity (every length <= capacity).
    Ties (equal lengths, equal room) go by index, so the result is deterministic."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row) sorted: bisect finds the tightest fit
    for i in order:
        n = int(lengths[i])
        k = bisect.bisect_left(room, (n, -1))
        if k == len(room):
            rows.append([i])
            left, r = capacity - n, len(rows) - 1
        else:
            left, r = room.pop(k)
            rows[r].append(i)
            left -= n
        bisect.insort(room, (left, r))
    return rows


def pack_plan(lengths: np.ndarray, capacity: int, seed: int, window: int = WINDOW) -> list[np.ndarray]:
    """The rows (arrays of record indices, in packing order) of the records with these packed
    lengths: best-fit-decreasing inside windows of a seeded permutation of the records."""
    g = torch.Generator().manual_seed(seed * 1_000_033 + 7)
    perm = torch.randperm(len(lengths), generator=g).numpy()
    rows = []
    for s in range(0, len(perm), window):
        ids = perm[s:s + window]
        rows += [ids[np.asarray(r)] for r in best_fit_decreasing(lengths[ids], capacity)]
    return rows


class PackedSFT(Dataset):
    """Rows of packed records (module docstring) over SFTSequences' ragged arrays: input_ids,
    labels, position_ids and doc_ids of seq_len tokens each."""

    def __init__(self, records, seed: int, window: int = WINDOW):
        self.records, self.seq_len, self.pad = records, records.seq_len, records.pad
        self.lengths = packed_lengths(records.offsets, records.seq_len)            # (records,)
        rows = pack_plan(self.lengths, records.seq_len, seed, window)
        self.row_starts = np.cumsum([0] + [len(r) for r in rows])                  # (rows + 1,)
        self.members = np.concatenate(rows) if rows else np.zeros(0, np.int64)     # record ids, row by row
        self.row_tokens = np.add.reduceat(self.lengths[self.members], self.row_starts[:-1]) if rows \
            else np.zeros(0, np.int64)                                             # (rows,) real tokens

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    def real_tokens(self, rows: list[int]) -> int:
        """Non-pad tokens of these rows (host arithmetic: the trainer's pad fraction)."""
        return int(self.row_tokens[rows].sum())

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < len(self):
            raise IndexError(i)
        T = self.seq_len
        input_ids = torch.full((T,), self.pad, dtype=torch.int64)
        labels = torch.full((T,), IGNORE_INDEX, dtype=torch.int64)
        position_ids = torch.zeros(T, dtype=torch.int64)
        doc_ids = torch.zeros(T, dtype=torch.int64)
        at = 0
        members = self.members[self.row_starts[i]:self.row_starts[i + 1]]
        for d, rec in enumerate(members):
            one = self.records[int(rec)]  # the unpacked sample: the same cut, labels and padding
            n = int(self.lengths[rec])
            input_ids[at:at + n] = one["input_ids"][:n]
            labels[at:at + n] = one["labels"][:n]
            position_ids[at:at + n] = torch.arange(n)
            doc_ids[at:at + n] = d
            at += n
        # The padding tail is a document of its own at positions 0..: nothing attends to it.
        position_ids[at:] = torch.arange(T - at)
        doc_ids[at:] = len(members)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids, "doc_ids": doc_ids}
