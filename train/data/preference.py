"""Preference pairs (`data.kind: preference`, trained with `train.objective: dpo`).

A record (a JSONL line, or a table row: train/data/records.py) is
    {"prompt": "...", "chosen": "...", "rejected": "..."}
or {"chosen", "rejected"} with the prompt implicit in both (extract_prompt: TRL's rule), or, as
chat messages (TRL's conversational format),
    {"prompt": [{"role": "user", "content": "..."}, ...],
     "chosen": [{"role": "assistant", "content": "..."}], "rejected": [{"role": "assistant", ...}]}
(a string response next to a message-list prompt is one assistant message).

Tokens. Each record gives two sequences, prompt + chosen and prompt + rejected, tokenized the way
data.kind sft tokenizes a record (train/data/sft.py: the tokenizer's chat template turn by turn,
else the plain format: BOS + prompt + response + EOS; bytes with NUL as EOS for the GPT presets).
Only response tokens (and the template's end-of-turn markup or the EOS after them) are labels;
the prompt and the padding are IGNORE_INDEX. The prompt and the response are tokenized apart and
their ids concatenated (as sft does), not as one joined text as TRL's DPOTrainer does: where a
tokenizer merges across the boundary (a prompt ending in a space) the ids differ from TRL's.

Truncation. The prompt is kept whole; each response is cut at its end, so that prompt +
response is at most data.seq_len + 1 tokens (seq_len inputs, seq_len labels). A prompt that
leaves no response token (prompt tokens >= data.seq_len) is a bad record.

Bad records stop the run before training with one line naming the file, the line and the field:
a missing or non-string/non-message field, an empty response, a prompt too long for
data.seq_len. A record whose chosen response is identical to its rejected one carries no
preference: it is skipped, counted, and the first one is named in one warning line.

Samples. One record = one sample: chosen_input_ids, chosen_labels, rejected_input_ids,
rejected_labels, each data.seq_len long (right-padded, as sft's samples; with data.pad_to
longest, LongestPairs pads a micro-batch only to its longest sequence). The objective
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


class LongestPairs(Dataset):
    """data.pad_to longest: the loader's view of PreferencePairs. Its samples are the pairs
    unpadded; `collate` right-pads the micro-batch's chosen and rejected rows to one length, the
    longest sequence of either side rounded up to a multiple of PAD_MULTIPLE, at most seq_len
    (one length for both: the objective concatenates them into one forward). Same pairs, same
    order as the seq_len layout; only trailing pad columns are left out, which no real token
    attends to, so the log-probs and the loss are the seq_len layout's."""

    def __init__(self, pairs: PreferencePairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict:
        p = self.pairs
        c, r = p.chosen.record(i), p.rejected.record(i)
        out = {"chosen_input_ids": c["input_ids"], "chosen_labels": c["labels"],
               "rejected_input_ids": r["input_ids"], "rejected_labels": r["labels"]}
        if p.reference is not None:
            out["reference_chosen_logps"] = torch.tensor(p.reference[0][i])
            out["reference_rejected_logps"] = torch.tensor(p.reference[1][i])
        return out

    def collate(self, samples: list[dict]) -> dict:
        from zerotrain.train.data.sft import PAD_MULTIPLE, pad_sample
        longest = max(s[f"{side}_input_ids"].numel() for s in samples for side in SIDES)
        T = min(self.pairs.chosen.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        out = {}
        for side in SIDES:
            rows = [pad_sample({"input_ids": s[f"{side}_input_ids"], "labels": s[f"{side}_labels"]}, T,
                               self.pairs.chosen.pad) for s in samples]
            out[f"{side}_input_ids"] = torch.stack([r["input_ids"] for r in rows])
            out[f"{side}_labels"] = torch.stack([r["labels"] for r in rows])
        if "reference_chosen_logps" in samples[0]:
            for key in ("reference_chosen_logps", "reference_rejected_logps"):
                out[key] = torch.stack([s[key] for s in samples])
        return out


HINT = '{"prompt", "chosen", "rejected"} or {"chosen", "rejected"}'


def _messages(value, where: str, key: str, trained: bool) -> list[tuple[str, str, bool]]:
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: "{key}" must be a string or a non-empty list of {{"role", "content"}} messages')
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f'{where}: "{key}"[{j}] must be an object with string "role" and "content"')
        if m["role"] not in ROLES:
            raise DataError(f'{where}: "{key}"[{j}] has the unknown role "{m["role"]}"; the roles are {", ".join(ROLES)}')
        out.append((m["role"], m["content"], trained and m["role"] == "assistant"))
    return out


def extract_prompt(chosen, rejected, where: str):
    """TRL's rule for an implicit prompt (trl.data_utils.extract_prompt): the prompt is the
    longest common prefix of chosen and rejected (characters of two strings, whole messages of
    two conversations), moved back by one where it ends just after a space so that the space
    starts the responses; when one is a prefix of the other TRL's loop stops one element early,
    and so does this. (prompt, chosen rest, rejected rest). No shared prefix at all is a bad
    record here (TRL would then look at the string's last character)."""
    if isinstance(chosen, list) != isinstance(rejected, list):
        raise DataError(f'{where}: "chosen" and "rejected" must both be strings or both message lists for an implicit '
                        f"prompt (no \"prompt\" column)")
    n = min(len(chosen), len(rejected))
    idx = n - 1
    for i in range(n):
        if chosen[i] != rejected[i]:
            idx = i
            break
    if idx >= 1 and chosen[idx - 1] == " ":
        idx -= 1
    if idx <= 0:
        raise DataError(f'{where}: "chosen" and "rejected" share no prefix, so there is no implicit prompt to '
                        f'extract; add a "prompt" column (explicit prompt) or fix the pair')
    return chosen[:idx], chosen[idx:], rejected[idx:]


def parse_record(rec: dict, where: str, formats: Optional[set] = None) -> tuple[list, list, list, bool]:
    """(prompt turns, chosen turns, rejected turns, is_chat) of one record, its format found from
    its keys (train/data/records.py PREFERENCE_FORMATS); DataError naming `where` and the field.
    Turns are (role, content, trained): only the responses' assistant messages are trained."""
    from zerotrain.train.data.records import PREFERENCE_FORMATS, detect, flavour, no_format
    fmt = detect(rec.keys(), "preference")
    if fmt is None:
        for key in FIELDS:
            if key not in rec and key != "prompt":
                raise DataError(f'{where}: missing "{key}" (a record is {HINT})')
        raise no_format(where, rec.keys(), "preference")
    if fmt is PREFERENCE_FORMATS[1]:
        rec = dict(zip(FIELDS, extract_prompt(rec["chosen"], rec["rejected"], where)))
    if formats is not None:
        formats.add(f"{fmt.name} ({flavour(rec['chosen'])})")
    chat = any(isinstance(rec[k], list) for k in FIELDS)
    parts = {}
    for key in FIELDS:
        v = rec[key]
        if isinstance(v, str):
            parts[key] = [("user", v, False) if key == "prompt" else ("assistant", v, True)]
        elif isinstance(v, list):
            parts[key] = _messages(v, where, key, trained=key != "prompt")
        else:
            raise DataError(f'{where}: "{key}" must be a string or a list of messages (got {type(v).__name__})')
    for key in SIDES:
        if not any(role == "assistant" and text for role, text, _ in parts[key]):
            raise DataError(f'{where}: empty "{key}": a response needs an assistant message with content')
    return parts["prompt"], parts["chosen"], parts["rejected"], chat


def read_rows(rows, enc: Encoder, seq_len: int, source=None, formats: Optional[set] = None
              ) -> tuple[Optional[PreferencePairs], int, Optional[str]]:
    """(every record of `rows` ((where, number, record), train/data/records.py) as pairs
    truncated to seq_len + 1 tokens (None if none is left), how many records had chosen ==
    rejected (skipped), the first such where). Each pair keeps its number (JSONL line, table row)."""
    import array
    wide = enc.vocab_size > 2 ** 31  # typed arrays: 4 (8) + 1 bytes a token, not Python lists of ints
    seqs = {s: (array.array("q" if wide else "i"), array.array("b"), [0]) for s in SIDES}
    lines, same, first_same = [], 0, None
    for where, number, rec in rows:
        prompt, chosen, rejected, chat = parse_record(rec, where, formats)
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
            ids_l.extend(ids[:seq_len + 1])
            trained_l.extend(trained[:seq_len + 1])
            offsets.append(len(ids_l))
        lines.append(number)
    if not lines:
        return None, same, first_same
    made = {s: SFTSequences(np.frombuffer(i, dtype=np.int64 if wide else np.int32), np.frombuffer(t, dtype=np.bool_),
                            np.asarray(o, dtype=np.int64), seq_len, enc.pad) for s, (i, t, o) in seqs.items()}
    return (PreferencePairs(made["chosen"], made["rejected"], np.asarray(lines, dtype=np.int64), source), same,
            first_same)


def read_pairs(path: Path, enc: Encoder, seq_len: int, formats: Optional[set] = None
               ) -> tuple[Optional[PreferencePairs], int, Optional[str]]:
    """read_rows of a JSONL file (each pair keyed by its line)."""
    from zerotrain.train.data.records import jsonl_rows
    with open_jsonl(path) as f:
        return read_rows(jsonl_rows(f, path, "preference", HINT), enc, seq_len, path, formats)


def read_table(table, enc: Encoder, seq_len: int, formats: Optional[set] = None):
    """read_rows of a `datasets` table (each pair keyed by its row)."""
    from zerotrain.train.data.records import table_format, table_rows
    return read_rows(table_rows(table, table_format(table, "preference")), enc, seq_len, None, formats)


def _concat(parts: list[PreferencePairs]) -> Optional[PreferencePairs]:
    """Pairs of several JSONL files, in order (no single source: not keyed for a precomputed reference)."""
    from zerotrain.train.data.sft import concat
    if not parts:
        return None
    return PreferencePairs(concat([p.chosen for p in parts]), concat([p.rejected for p in parts]),
                           np.concatenate([p.lines for p in parts]), None)


def _slice(pairs: PreferencePairs, start: int, stop: int) -> PreferencePairs:
    return PreferencePairs(subset(pairs.chosen, start, stop), subset(pairs.rejected, start, stop),
                           pairs.lines[start:stop], pairs.source)


def build_preference(cfg: PreferenceData, seq_len: Optional[int], tokenizer: Optional[str],
                     warn=print) -> DataBundle:
    """`tokenizer`: a local Hugging Face tokenizer directory, or None for bytes."""
    if cfg.path is None:
        raise DataError('data.kind = preference needs data.path (a .jsonl, .parquet or .arrow file or glob of '
                        f'{HINT} records, or a save_to_disk directory)')
    if seq_len is None:
        raise DataError("data.kind = preference needs data.seq_len (the model has no context length to default to)")
    from zerotrain.train.data.records import is_table_spec, open_source
    path = Path(cfg.path).expanduser()
    table = is_table_spec(cfg.path)
    if not table and not path.is_file():
        raise DataError(f'data.path {path} does not exist (data.kind = preference expects a .jsonl, .parquet or '
                        f'.arrow file or glob of {HINT} records, or a save_to_disk directory)')
    enc = hf_encoder(tokenizer, cfg.chat_template) if tokenizer else byte_encoder()
    formats: set = set()
    val = None
    if table:
        src = open_source(cfg.path, "preference", cfg.subset, cfg.split)
        if src.is_table:
            pairs, same, first_same = read_table(src.table, enc, seq_len, formats)
            val_name, val_what = src.val_name, src.val_table.name if src.val_table is not None else None
            if src.val_table is not None:
                val, v_same, v_first = read_table(src.val_table, enc, seq_len)
        else:  # a glob of JSONL files
            parts = [read_pairs(f, enc, seq_len, formats) for f in src.jsonl]
            pairs = _concat([p for p, _, _ in parts if p is not None])
            same, first_same = sum(n for _, n, _ in parts), next((w for _, _, w in parts if w), None)
    else:
        from zerotrain.train.data.sft import _local_only
        _local_only(cfg)
        pairs, same, first_same = read_pairs(path, enc, seq_len, formats)
        val_file = val_path(path)
        val_name = val_what = val_file.name
        if val_file.is_file() and val_file != path:
            val, v_same, v_first = read_pairs(val_file, enc, seq_len)
            val_what = val_file
    if val is not None and v_same:
        warn(f"zerotrain: WARNING: {v_same} record(s) of {val_what} have chosen identical to rejected (first: "
             f"{v_first}); skipped, they carry no preference")
    if same:
        warn(f"zerotrain: WARNING: {same} record(s) of {cfg.path} have chosen identical to rejected (first: "
             f"{first_same}); skipped, they carry no preference")
    if pairs is None:
        raise DataError(f"data.path {cfg.path} holds no usable records; data.kind preference needs records "
                        f'{HINT} with chosen != rejected')
    if val is not None:
        train, split = pairs, f"val: {val_name}"
    else:
        n_val = int(len(pairs) * cfg.val_fraction)
        train = _slice(pairs, 0, len(pairs) - n_val)
        val = _slice(pairs, len(pairs) - n_val, len(pairs)) if n_val else None
        split = f"val: last {n_val} records" if n_val else "no validation"
    for split_pairs in (train, val):
        if split_pairs is not None:
            split_pairs.packing = cfg.packing
    fmt = "chat template" if enc.render else "plain format"
    from zerotrain.train.data.sft import PAD_MULTIPLE
    layout = (f"packed into rows of {seq_len}" if cfg.packing else f"padded to {seq_len}" if cfg.pad_to == "seq_len"
              else f"padded to each batch's longest sequence (a multiple of {PAD_MULTIPLE}, at most {seq_len})")
    labelled = sum(int((s.trained.sum() - s.trained[s.offsets[:-1]].sum())) for s in (train.chosen, train.rejected))
    skipped = f", {same} with chosen == rejected skipped" if same else ""
    return DataBundle(train=train, val=val, task="lm", items_per_sample=2 * seq_len, vocab_size=enc.vocab_size,
                      seq_len=seq_len, decode=enc.decode, masked_labels=False,
                      describe=f"preference pairs {cfg.path} ({len(train)} records{skipped}, {labelled} response tokens, "
                               f"format {', '.join(sorted(formats))}, "
                               f"{'bytes' if enc.name == 'bytes' else 'tokenizer ' + enc.name} {fmt}, chosen and "
                               f"rejected {layout}; {split})",
                      extra={"max_token": max(int(train.chosen.ids.max()), int(train.rejected.ids.max())),
                             "token_file": str(path), "tokenizer": enc.name, "preference": True,
                             "tokenizer_sha256": enc.identity(), "chat_template": enc.render is not None,
                             "skipped_identical": same, "formats": sorted(formats), "packed": "data.packing" if cfg.packing else None,
                             "pad_to": None if cfg.packing else cfg.pad_to, "layout": layout})
