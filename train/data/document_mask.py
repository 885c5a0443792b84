"""Document masking for pre-training windows (`data.document_mask: true`; Llama 3's intra-document
masking): a window that spans several documents attends only inside each of them.

Token data is one stream of documents, each ended by the tokenizer's EOS (`zerotrain prepare`
and data.kind stream put it after every document). A window's input tokens get the fields of
packed sft rows (train/data/packing.py), so they take the same model path (models/workload.py):

    doc_ids[i]      = EOS tokens among inputs[0:i]   (an EOS belongs to the document it ends)
    position_ids[i] = i - the start of that document  (restarting at 0 after each EOS)

The first document of a window starts at the window's start (position 0), as without the mask.
The label of an EOS input is the next document's first token, predicted from the ended document
alone, as Llama 3 and torchtitan train it. Both fields are a pure function of the window's
tokens: nothing to save, resume is exact, and the sampler's order is unchanged.

The EOS id: data.eos_id, else the separator `zerotrain prepare` recorded in the token file's
sidecar or the shards' manifest, else the stream tokenizer's EOS. Byte-level data is refused
(its separator is a newline, which also ends every line), so is a file whose EOS is unknown or
cannot be found in its first HEAD_TOKENS tokens (a cheap, bounded check).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.train.errors import DataError

HEAD_TOKENS = 1 << 24  # tokens read to check that the EOS id occurs (~32-64 MB, once at start-up)
FLAG = "data.document_mask"


def document_fields(input_ids: torch.Tensor, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_ids, doc_ids) of a window's inputs (T,) int64: see the module docstring."""
    T = input_ids.size(0)
    ends = input_ids[:-1] == eos                                  # an EOS at i: a document starts at i + 1
    doc_ids = torch.zeros(T, dtype=torch.int64)
    doc_ids[1:] = torch.cumsum(ends, 0)
    idx = torch.arange(T)
    starts = torch.zeros(T, dtype=torch.int64)
    starts[1:] = torch.where(ends, idx[1:], 0)
    return idx - torch.cummax(starts, 0).values, doc_ids


class DocumentMasked(Dataset):
    """The windows of `inner` with position_ids and doc_ids added (same length, same order)."""

    def __init__(self, inner: Dataset, eos: int):
        self.inner, self.eos = inner, eos

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        sample = self.inner[i]
        position_ids, doc_ids = document_fields(sample["input_ids"], self.eos)
        return {**sample, "position_ids": position_ids, "doc_ids": doc_ids}


def resolve_eos(cfg, where: str, tokenizer: Optional[str], separator: Optional[list], max_token: Optional[int],
                head: Optional[Callable[[], np.ndarray]] = None) -> int:
    """The EOS id of the data in `where` (one line naming the fix when it is unknown or absent).
    separator: what prepare (or the stream's tokenizer) puts after each document; None: unrecorded.
    head(): the first tokens of the data, for the bounded occurrence check (None: not checked)."""
    eos = cfg.eos_id
    if eos is None:
        if tokenizer == "bytes":
            raise DataError(f"{FLAG}: {where} is byte-level: its document separator is a newline, which also ends "
                            f"every line; prepare the text with --tokenizer DIR (a tokenizer with an EOS token), or "
                            f"set data.eos_id to an id that only ends documents")
        if separator is None:
            raise DataError(f"{FLAG}: {where} does not record its tokenizer's EOS id (not written by this "
                            f"`zerotrain prepare`); set data.eos_id to the id that ends each document, or re-run "
                            f"`zerotrain prepare`")
        if len(separator) != 1:
            raise DataError(f"{FLAG}: {where} was tokenized by {tokenizer}, which has no EOS token, so its documents "
                            f"are not separated; prepare it with a tokenizer that has one, or remove {FLAG}")
        eos = int(separator[0])
    if max_token is not None and eos > max_token:
        raise DataError(f"{FLAG}: EOS id {eos} never occurs in {where} (its largest id is {max_token}); set "
                        f"data.eos_id to the id that ends its documents, or remove {FLAG}")
    if head is not None and not np.any(head() == eos):
        raise DataError(f"{FLAG}: EOS id {eos} does not occur in the first {HEAD_TOKENS:,} tokens of {where}; set "
                        f"data.eos_id to the id that ends its documents, or remove {FLAG}")
    return eos


def apply(bundle, eos: int):
    """The bundle with both splits document-masked, marked for the model's packing check."""
    bundle.train = DocumentMasked(bundle.train, eos)
    if bundle.val is not None:
        bundle.val = DocumentMasked(bundle.val, eos)
    bundle.extra.update(packed=FLAG, eos_id=eos)
    bundle.describe += f"; document-masked at EOS id {eos}"
    return bundle
