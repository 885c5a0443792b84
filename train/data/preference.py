"""Preference pairs (`data.kind: preference`, trained with `train.objective: dpo`).

A record is one JSONL line
    {"prompt": "...", "chosen": "...", "rejected": "..."}
or, as chat messages (TRL's conversational format),
    {"prompt": [{"role": "user", "content": "..."}, ...],
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": [{"role": "assistant", ...}]}
(a string response next to a message-list prompt is one assistant message).

Tokens. Each record gives two sequences, prompt + chosen and prompt + rejected, tokenized the way
data.kind sft tokenizes a record (train/data/sft.py: the tokenizer's chat template turn by turn,
else the plain format: BOS + prompt + response + EOS; bytes with NUL as EOS for the GPT presets).
Only response tokens (and the template's end-of-turn markup or the EOS after them) are labels;
the prompt and the padding are IGNORE_INDEX.

Truncation. The prompt is kept whole; each response is cut at its end, so that prompt +
response is at most data.seq_len + 1 tokens (seq_len inputs, seq_len labels). A prompt that
leaves no response token (prompt tokens >= data.seq_len) is a bad record.

Bad records stop the run before training with one line naming the file, the line and the field:
a missing or non-string/non-message field, an empty response, a prompt too long for
data.seq_len. A record whose chosen response is identical to its rejected one carries no
preference: it is skipped, counted, and the first one is named in one warning line.

Samples. One record = one sample: chosen_input_ids, chosen_labels, rejected_input_ids,
rejected_labels, each data.seq_len long (right-padded, as sft's samples). The objective
(models/preference.py) concatenates them along the batch: one forward for both. With
data.packing each sample also carries chosen_length / rejected_length (the sequence's input
tokens after truncation), and the objective packs the micro-batch's sequences into rows of
seq_len with the document mask instead (models/preference.py pack_sequences): a sample is still
one pair, so the sampler, the batches and the loss's mean over pairs are packing's off.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.train.config import PreferenceData
from zerotrain.train.data.bundle import DataBundle
from zerotrain.train.data.sft import (ROLES, Encoder, SFTSequences, byte_encoder, hf_encoder, open_jsonl, subset,
                                      tokenize, val_path)
from zerotrain.train.data.sft_file import first_label
from zerotrain.train.errors import DataError

FIELDS = ("prompt", "chosen", "rejected")
SIDES = ("chosen", "rejected")


class PreferencePairs(Dataset):
    """Pairs as two aligned SFTSequences (record i of each is the record's chosen / rejected)."""

    def __init__(self, chosen: SFTSequences, rejected: SFTSequences, lines: np.ndarray,
                 source: Optional[Path] = None):
        assert len(chosen) == len(rejected) == len(lines)
        self.chosen, self.rejected, self.lines = chosen, rejected, lines  # lines: each record's JSONL line
        self.source = source                  # the JSONL file the records come from
        self.packing = False                  # data.packing: samples carry each sequence's length
        self.reference: Optional[tuple[np.ndarray, np.ndarray]] = None  # precomputed (chosen, rejected) logps

    def attach_reference(self, chosen: np.ndarray, rejected: np.ndarray) -> None:
        """train.dpo.reference precomputed: each sample then carries its reference log-probs
        (train/data/reference.py), as reference_chosen_logps / reference_rejected_logps."""
        assert len(chosen) == len(rejected) == len(self)
        self.reference = (chosen, rejected)

    def __len__(self) -> int:
        return len(self.chosen)

    def real_tokens(self, rows: list[int]) -> int:
        return self.chosen.real_tokens(rows) + self.rejected.real_tokens(rows)

    def __getitem__(self, i: int) -> dict:
        c, r = self.chosen[i], self.rejected[i]
        out = {"chosen_input_ids": c["input_ids"], "chosen_labels": c["labels"],
               "rejected_input_ids": r["input_ids"], "rejected_labels": r["labels"]}
        if self.packing:  # the input tokens of each sequence (SFTSequences' cut: at most seq_len)
            for side, seqs in (("chosen", self.chosen), ("rejected", self.rejected)):
                n = min(int(seqs.offsets[i + 1] - seqs.offsets[i]), seqs.seq_len + 1) - 1
                out[f"{side}_length"] = torch.tensor(n, dtype=torch.int64)
        if self.reference is not None:
            out["reference_chosen_logps"] = torch.tensor(self.reference[0][i])
            out["reference_rejected_logps"] = torch.tensor(self.reference[1][i])
        return out


def _messages(value, where: str, key: str) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: "{key}" must be a string or a non-empty list of {{"role", "content"}} messages')
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f'{where}: "{key}"[{j}] must be an object with string "role" and "content"')
        if m["role"] not in ROLES:
            raise DataError(f'{where}: "{key}"[{j}] has the unknown role "{m["role"]}"; the roles are {", ".join(ROLES)}')
        out.append((m["role"], m["content"]))
    return out


def parse_pair(line: str, where: str) -> tuple[list, list, list, bool]:
    """(prompt turns, chosen turns, rejected turns, is_chat) of one JSONL line; DataError naming
    `where` (file:line) and the field."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f'{where}: not JSON ({e.msg}, column {e.colno}); data.kind preference reads JSONL, one '
                        f'{{"prompt", "chosen", "rejected"}} object per line') from None
    if not isinstance(rec, dict):
        raise DataError(f'{where}: a JSON {type(rec).__name__}, not a {{"prompt", "chosen", "rejected"}} object')
    for key in FIELDS:
        if key not in rec:
            raise DataError(f'{where}: missing "{key}" (a record is {{"prompt", "chosen", "rejected"}})')
    chat = any(isinstance(rec[k], list) for k in FIELDS)
    parts = {}
    for key in FIELDS:
        v = rec[key]
        if isinstance(v, str):
            parts[key] = [("user" if key == "prompt" else "assistant", v)]
        elif isinstance(v, list):
            parts[key] = _messages(v, where, key)
        else:
            raise DataError(f'{where}: "{key}" must be a string or a list of messages (got {type(v).__name__})')
    for key in SIDES:
        if not any(role == "assistant" and text for role, text in parts[key]):
            raise DataError(f'{where}: empty "{key}": a response needs an assistant message with content')
    return parts["prompt"], parts["chosen"], parts["rejected"], chat


def read_pairs(path: Path, enc: Encoder, seq_len: int) -> tuple[Optional[PreferencePairs], int, Optional[str]]:
    """(every record of a JSONL file as pairs truncated to seq_len + 1 tokens (None if none is
    left), how many records had chosen == rejected (skipped), the first such file:line)."""
    seqs = {s: ([], [], [0]) for s in SIDES}
    lines, same, first_same = [], 0, None
    with open_jsonl(path) as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not UTF-8 text; data.kind preference reads JSONL") from None
            if not line.strip():
                continue
            prompt, chosen, rejected, chat = parse_pair(line, where)
            if chosen == rejected:
                same += 1
                first_same = first_same or where
                continue
            for side, resp in (("chosen", chosen), ("rejected", rejected)):
                ids, trained = tokenize(prompt + resp, chat, enc, where)
                prompt_len = first_label(trained)  # the tokens before the first label: the prompt (+ markup)
                if prompt_len > seq_len:
                    raise DataError(f'{where}: "prompt" is {prompt_len} tokens, data.seq_len {seq_len} leaves no '
                                    f'"{side}" token (the prompt is kept whole, responses are cut at their end); '
                                    f"raise data.seq_len or shorten the prompt")
                ids_l, trained_l, offsets = seqs[side]
                ids_l += ids[:seq_len + 1]
                trained_l += trained[:seq_len + 1]
                offsets.append(len(ids_l))
            lines.append(lineno)
    if not lines:
        return None, same, first_same
    dtype = np.int64 if enc.vocab_size > 2 ** 31 else np.int32
    made = {s: SFTSequences(np.asarray(i, dtype=dtype), np.asarray(t, dtype=np.bool_), np.asarray(o, dtype=np.int64),
                            seq_len, enc.pad) for s, (i, t, o) in seqs.items()}
    return (PreferencePairs(made["chosen"], made["rejected"], np.asarray(lines, dtype=np.int64), path), same,
            first_same)


def _slice(pairs: PreferencePairs, start: int, stop: int) -> PreferencePairs:
    return PreferencePairs(subset(pairs.chosen, start, stop), subset(pairs.rejected, start, stop),
                           pairs.lines[start:stop], pairs.source)


def build_preference(cfg: PreferenceData, seq_len: Optional[int], tokenizer: Optional[str],
                     warn=print) -> DataBundle:
    """`tokenizer`: a local Hugging Face tokenizer directory, or None for bytes."""
    if cfg.path is None:
        raise DataError('data.kind = preference needs data.path (a .jsonl file of {"prompt", "chosen", "rejected"} '
                        "records)")
    if seq_len is None:
        raise DataError("data.kind = preference needs data.seq_len (the model has no context length to default to)")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise DataError(f'data.path {path} does not exist (data.kind = preference expects a .jsonl file of '
                        f'{{"prompt", "chosen", "rejected"}} records)')
    enc = hf_encoder(tokenizer, cfg.chat_template) if tokenizer else byte_encoder()
    pairs, same, first_same = read_pairs(path, enc, seq_len)
    val_file, val = val_path(path), None
    if val_file.is_file() and val_file != path:
        val, v_same, v_first = read_pairs(val_file, enc, seq_len)
        if v_same:
            warn(f"zerotrain: WARNING: {v_same} record(s) of {val_file} have chosen identical to rejected (first: "
                 f"{v_first}); skipped, they carry no preference")
    if same:
        warn(f"zerotrain: WARNING: {same} record(s) of {path} have chosen identical to rejected (first: {first_same}); "
             f"skipped, they carry no preference")
    if pairs is None:
        raise DataError(f"data.path {path} holds no usable records; data.kind preference needs JSONL records "
                        f'{{"prompt", "chosen", "rejected"}} with chosen != rejected')
    if val is not None:
        train, split = pairs, f"val: {val_file.name}"
    else:
        n_val = int(len(pairs) * cfg.val_fraction)
        train = _slice(pairs, 0, len(pairs) - n_val)
        val = _slice(pairs, len(pairs) - n_val, len(pairs)) if n_val else None
        split = f"val: last {n_val} records" if n_val else "no validation"
    for split_pairs in (train, val):
        if split_pairs is not None:
            split_pairs.packing = cfg.packing
    fmt = "chat template" if enc.render else "plain format"
    labelled = sum(int((s.trained.sum() - s.trained[s.offsets[:-1]].sum())) for s in (train.chosen, train.rejected))
    skipped = f", {same} with chosen == rejected skipped" if same else ""
    return DataBundle(train=train, val=val, task="lm", items_per_sample=2 * seq_len, vocab_size=enc.vocab_size,
                      seq_len=seq_len, decode=enc.decode, masked_labels=False,
                      describe=f"preference pairs {path} ({len(train)} records{skipped}, {labelled} response tokens, "
                               f"{'bytes' if enc.name == 'bytes' else 'tokenizer ' + enc.name} {fmt}, chosen and "
                               f"rejected {'packed into rows of' if cfg.packing else 'padded to'} {seq_len}; {split})",
                      extra={"max_token": max(int(train.chosen.ids.max()), int(train.rejected.ids.max())),
                             "token_file": str(path), "tokenizer": enc.name, "preference": True,
                             "tokenizer_sha256": enc.identity(), "chat_template": enc.render is not None,
                             "skipped_identical": same, "packed": "data.packing" if cfg.packing else None})
