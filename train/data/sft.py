"""Instruction data (`data.kind: sft`): records, the loss on the responses only.

Records come from a JSONL file or a table (parquet, arrow, save_to_disk, a Hub dataset id:
train/data/records.py), in one of TRL's formats found from the columns (record_turns):
    {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
        every assistant message is trained (at least one with content);
    {"prompt", "completion"} strings or message lists: the completion is trained;
    {"prompt": "...", "response": "..."}: zerotrain's own name for the standard one;
    {"text": "..."}: every token is trained (BOS + text + EOS, never templated).

Tokens. With the tokenizer's chat template (data.chat_template, when the tokenizer has one)
the record is rendered turn by turn: the text a turn adds, template markup included, is
tokenized as its own segment; an assistant turn's segment (its content and the template's
end-of-turn markup after it) is trained, everything else (system and user turns, the
generation prompt that introduces the assistant) is not. Without a template: BOS (if the
tokenizer adds one) + prompt + response + EOS, or for conversations "role: content\n" per
turn with an assistant turn's content + EOS trained. zerotrain's byte-level GPT reads the
UTF-8 bytes (vocab 256) with NUL (0) as EOS.

Samples. One record = one sample of data.seq_len tokens: its first seq_len + 1 tokens give
input = ids[:-1] and labels = ids[1:], a label set to IGNORE_INDEX (-100) where its token is
not trained. Shorter records are right-padded (pad id as input, -100 as label): by default
(data.pad_to longest) only as far as the micro-batch's longest record, rounded up to a multiple
of 64 (LongestPadding, the loader's view), else to seq_len. Right padding
needs no attention mask for causal models: a token attends only to the positions before it,
never to the pads after it, and positions stay 0..T-1 as in an unpadded sequence. With
data.packing a sample is instead a row of several records (train/data/packing.py). The order is the GlobalBatchSampler's (train/data/sampler.py): per record,
world-size independent and resumable, like every other kind.

Validation: a sibling `<name>.val.jsonl` if present, else the last data.val_fraction of the
records. A bad record stops the run before training with one line naming the file and line.

Prepared sets: `zerotrain prepare --sft` runs encoded_records (the one record -> tokens
function) once and stores whole records (train/data/sft_file.py); a .bin data.path is read
memory-mapped into the same SFTSequences, which cut to seq_len when read: the same samples as
from the JSONL, refused if made with another tokenizer or chat-template setting.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from zerotrain.models.losses import IGNORE_INDEX
from zerotrain.train.config import SftData
from zerotrain.train.data.text import VOCAB, decode as decode_bytes
from zerotrain.train.data.bundle import DataBundle
import zerotrain.train.data.sft_file as sft_file
from zerotrain.train.data.sft_file import first_label
from zerotrain.train.errors import DataError

ROLES = ("system", "user", "assistant")
BYTE_EOS = 0  # NUL: never in text, so it cannot be confused with response content


@dataclass
class Encoder:
    """What tokenizing a record needs from a tokenizer."""
    name: str
    vocab_size: int
    encode: Callable[[str], list[int]]    # text -> ids, no special tokens added
    eos: int
    pad: int
    bos: list[int]                        # prepended in the plain format ([] or [BOS])
    decode: Callable
    render: Optional[Callable] = None     # (messages, add_generation_prompt) -> text: the chat template
    identity: Callable[[], str] = lambda: "bytes"  # sha256 of what fixes the ids (prepared sets must match)


def byte_encoder() -> Encoder:
    return Encoder(name="bytes", vocab_size=VOCAB, encode=lambda s: list(s.encode("utf-8")), eos=BYTE_EOS,
                   pad=BYTE_EOS, bos=[], decode=decode_bytes)


def hf_encoder(directory: str, use_template: bool) -> Encoder:
    """`directory`: a local tokenizer directory or a Hub id (models/hub.py: its cached snapshot)."""
    import zerotrain.models.hub as hub
    d = hub.local_path(directory, "data.tokenizer")
    if not d.is_dir():
        raise DataError(f"data.tokenizer {d} is not a directory; give a local Hugging Face tokenizer directory or a "
                        f"Hub id org/name[@revision]")
    from transformers import AutoTokenizer  # late: only sft runs with a Hugging Face tokenizer need it
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"data.kind sft: cannot load a tokenizer from {d} ({str(e).splitlines()[0][:200]}); "
                        f"set data.tokenizer to a directory holding tokenizer.json / tokenizer.model") from None
    if tok.eos_token_id is None:
        raise DataError(f"the tokenizer in {d} has no EOS token: a response could not end; use another tokenizer")
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and \
        tok("a")["input_ids"][:1] == [tok.bos_token_id] else []  # only if the tokenizer itself adds it
    def template(messages, add_generation_prompt):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    render = template if use_template and getattr(tok, "chat_template", None) else None
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return Encoder(name=str(d), vocab_size=len(tok), encode=lambda s: tok(s, add_special_tokens=False)["input_ids"],
                   eos=tok.eos_token_id, pad=pad, bos=bos, decode=lambda ids: tok.decode(list(ids)), render=render,
                   identity=lambda: tokenizer_identity(tok, bos, pad))


def tokenizer_identity(tok, bos: list[int], pad: int) -> str:
    """sha256 over everything that decides a record's ids: the whole tokenizer (its tokenizer.json
    serialisation when it is a fast one, else its vocabulary), the special ids and the chat
    template. By content, not path: the same tokenizer copied into a model directory matches."""
    import hashlib
    backend = getattr(tok, "backend_tokenizer", None)
    h = hashlib.sha256(backend.to_str().encode() if backend is not None else
                       json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps([bos, tok.eos_token_id, pad, getattr(tok, "chat_template", None)]).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- records

# A record as turns: (role, content, trained). The plain prompt-response record is
# [("user", prompt, False), ("assistant", response, True)]; a conversation's assistant turns are
# trained, except those of a prompt-completion record's prompt (TRL trains the completion only).
# The language-modeling "text" record is [(TEXT, text, True)]: every token trained, never templated.
TEXT = "text"
HINT = '{"messages"}, {"prompt", "completion"}, {"prompt", "response"} or {"text"}'


def messages(value, where: str, key: str, trained=lambda role: role == "assistant") -> list[tuple[str, str, bool]]:
    """[(role, content, trained)] of a list of {"role", "content"} messages; DataError naming `where` and `key`."""
    if not isinstance(value, list) or not value:
        raise DataError(f'{where}: "{key}" must be a non-empty list of {{"role", "content"}} objects')
    turns = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f'{where}: {key}[{j}] must be an object with string "role" and "content"')
        if m["role"] not in ROLES:
            raise DataError(f'{where}: {key}[{j}] has the unknown role "{m["role"]}"; the roles are '
                            f'{", ".join(ROLES)}')
        turns.append((m["role"], m["content"], trained(m["role"])))
    return turns


def record_turns(rec: dict, where: str) -> tuple[list[tuple[str, str, bool]], bool, str]:
    """(turns, is_chat, format name) of one record, its format found from its keys
    (train/data/records.py SFT_FORMATS); DataError naming `where` (file:line or file:row N)."""
    from zerotrain.train.data.records import SFT_FORMATS, detect, flavour, no_format
    fmt = detect(rec.keys(), "sft")
    if fmt is None:
        if "prompt" in rec:  # the prompt is there, its response is not
            raise DataError(f'{where}: missing "response" (or TRL\'s "completion"); a record is {HINT}')
        raise no_format(where, rec.keys(), "sft")
    name = fmt.name
    if fmt is SFT_FORMATS[0]:
        turns = messages(rec["messages"], where, "messages")
        if not any(role == "assistant" and text for role, text, _ in turns):
            raise DataError(f"{where}: no assistant message with content: nothing to train on")
        return turns, True, name
    if fmt is SFT_FORMATS[3]:
        if not isinstance(rec["text"], str):
            raise DataError(f'{where}: "text" must be a string (got {type(rec["text"]).__name__})')
        if not rec["text"]:
            raise DataError(f'{where}: empty "text": nothing to train on')
        return [(TEXT, rec["text"], True)], False, name
    resp_key = fmt.columns[1]
    prompt, resp = rec["prompt"], rec[resp_key]
    if isinstance(prompt, list) or isinstance(resp, list):  # conversational prompt-completion
        p_turns = messages(prompt, where, "prompt", trained=lambda role: False) if isinstance(prompt, list) else \
            [("user", _string(prompt, where, "prompt"), False)]
        r_turns = messages(resp, where, resp_key) if isinstance(resp, list) else \
            [("assistant", _string(resp, where, resp_key), True)]
        if not any(role == "assistant" and text for role, text, _ in r_turns):
            raise DataError(f'{where}: empty "{resp_key}": it needs an assistant message with content')
        return p_turns + r_turns, True, f"{name} ({flavour(prompt if isinstance(prompt, list) else resp)})"
    _string(prompt, where, "prompt")
    _string(resp, where, resp_key)
    if not resp:
        raise DataError(f'{where}: empty "{resp_key}": nothing to train on')
    return [("user", prompt, False), ("assistant", resp, True)], False, name if resp_key == "response" else \
        f"{name} (standard)"


def _string(value, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise DataError(f'{where}: "{key}" must be a string (got {type(value).__name__})')
    return value


def segments(turns: list[tuple[str, str, bool]], chat: bool, enc: Encoder,
             where: str) -> list[tuple[str, bool, bool]]:
    """The record as (text, trained, ends a response) pieces, in order (module docstring); the
    plain format appends EOS after a piece that ends a response."""
    if turns and turns[0][0] == TEXT:
        return [(turns[0][1], True, True)]
    if enc.render is None:
        if not chat:
            return [(turns[0][1], False, False), (turns[1][1], True, True)]
        out = []
        for role, text, trained in turns:
            out += [(f"{role}: ", False, False), (text, trained, True)] if role == "assistant" else \
                [(f"{role}: {text}\n", False, False)]
        return out
    msgs = [{"role": r, "content": c} for r, c, _ in turns]
    out, prev = [], ""

    def add(text: str, trained: bool):
        nonlocal prev
        if not text.startswith(prev):  # the template rewrote earlier turns: no clean split into turns
            raise DataError(f"{where}: the chat template of {enc.name} does not render this conversation turn "
                            f"by turn (a later turn changes earlier text); set data.chat_template false")
        out.append((text[len(prev):], trained, False))
        prev = text

    try:
        for i, (role, _, trained) in enumerate(turns):
            if role == "assistant":
                add(enc.render(msgs[:i], True), False)   # history + the generation prompt
                add(enc.render(msgs[:i + 1], False), trained)
            else:
                add(enc.render(msgs[:i + 1], False), False)
    except DataError:
        raise
    except Exception as e:  # jinja's own errors (e.g. a template that refuses a system turn)
        raise DataError(f"{where}: the chat template of {enc.name} refuses this record "
                        f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}); fix the record or set "
                        f"data.chat_template false") from None
    return out


def tokenize(turns, chat: bool, enc: Encoder, where: str) -> tuple[list[int], list[bool]]:
    """(ids, trained per id) of a whole record, before truncation. A "text" record is always the
    plain format (TRL applies no chat template to it): BOS + text + EOS, all trained."""
    ids, trained = [], []
    plain = enc.render is None or (turns and turns[0][0] == TEXT)
    if plain:
        ids += enc.bos
        trained += [False] * len(enc.bos)
    for text, train, ends in segments(turns, chat, enc, where):
        piece = enc.encode(text)
        ids += piece
        trained += [train] * len(piece)
        if ends and plain:  # plain format: a response ends with EOS, learnt where the response is
            ids.append(enc.eos)
            trained.append(train)
    return ids, trained


# ----------------------------------------------------------------------------- dataset

class SFTSequences(Dataset):
    """Records as ragged token arrays (ids, bool trained flags, offsets; in memory from JSONL or
    memory-mapped from a prepared set): samples are cut and padded to seq_len when read, so
    memory follows the tokens, not records x seq_len."""

    def __init__(self, ids: np.ndarray, trained: np.ndarray, offsets: np.ndarray, seq_len: int, pad: int):
        self.ids, self.trained, self.offsets = ids, trained, offsets
        self.seq_len, self.pad = seq_len, pad

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def real_tokens(self, rows: list[int]) -> int:
        """Non-pad tokens of these samples (host arithmetic: the trainer's pad fraction)."""
        lengths = np.minimum(self.offsets[np.asarray(rows) + 1] - self.offsets[np.asarray(rows)], self.seq_len + 1)
        return int((lengths - 1).sum())

    def __getitem__(self, i: int) -> dict:
        return pad_sample(self.record(i), self.seq_len, self.pad)

    def record(self, i: int) -> dict:
        """Record i's input_ids and labels, unpadded: n - 1 positions (n <= seq_len + 1 tokens)."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        e = min(e, s + self.seq_len + 1)  # prepared records are stored whole: cut here, as read_records does
        ids = torch.from_numpy(self.ids[s:e].astype(np.int64))     # (n,), n <= seq_len + 1
        # a copy: prepared flags are a read-only memmap, which torch.from_numpy warns about
        keep = torch.from_numpy(self.trained[s + 1:e].astype(np.bool_))  # (n-1,): is label j a trained token
        return {"input_ids": ids[:-1], "labels": torch.where(keep, ids[1:], torch.full_like(ids[1:], IGNORE_INDEX))}


def pad_sample(rec: dict, T: int, pad: int) -> dict:
    """A record's input_ids / labels right-padded to T positions (pad id, IGNORE_INDEX)."""
    n = rec["input_ids"].numel()
    input_ids = torch.full((T,), pad, dtype=torch.int64)
    labels = torch.full((T,), IGNORE_INDEX, dtype=torch.int64)
    input_ids[:n], labels[:n] = rec["input_ids"], rec["labels"]
    return {"input_ids": input_ids, "labels": labels}


PAD_MULTIPLE = 64  # data.pad_to longest rounds a batch's length up to this (fewer distinct shapes)


class LongestPadding(Dataset):
    """data.pad_to longest: the loader's view of SFTSequences. Its samples are the records
    unpadded; `collate` right-pads a micro-batch to its longest record rounded up to a multiple
    of PAD_MULTIPLE, at most seq_len. Same indices, same records, same order as the fixed
    layout: only the trailing pad columns that every row of the batch has are left out, and no
    real token attends to a later position, so the loss is the fixed layout's."""

    def __init__(self, seqs: SFTSequences):
        self.seqs = seqs

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> dict:
        return self.seqs.record(i)

    def collate(self, samples: list[dict]) -> dict:
        longest = max(s["input_ids"].numel() for s in samples)
        T = min(self.seqs.seq_len, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE)
        rows = [pad_sample(s, T, self.seqs.pad) for s in samples]
        return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}


def fixed_length_reason(sp_size: int, compile_: bool, moe: bool, model_loss: bool) -> str | None:
    """Why a run pads every sample to data.seq_len although data.pad_to is longest (None: it
    need not): see SftData.pad_to."""
    if sp_size > 1:
        return "sequence parallelism splits every row into equal slices"
    if compile_:
        return "hardware.compile: one graph for one length"
    if moe:
        return "the MoE router's aux loss counts pad positions"
    if model_loss:
        return "the py: model computes its own loss"
    return None


def encoded_rows(rows, enc: Encoder, formats: Optional[set] = None) -> Iterator[tuple[int, list[int], list[bool]]]:
    """(row number, ids, trained per id) of every record of `rows` ((where, number, record) from
    train/data/records.py), full length: the one record -> tokens function, shared by training
    (read_records) and `zerotrain prepare --sft`, so both validate and tokenize alike. A bad
    record raises DataError naming its `where`. `formats` collects the format names seen."""
    for where, number, rec in rows:
        turns, chat, fmt = record_turns(rec, where)
        if formats is not None:
            formats.add(fmt)
        ids, trained = tokenize(turns, chat, enc, where)
        yield number, ids, trained


def encoded_records(lines: Iterable[bytes], name, enc: Encoder, formats: Optional[set] = None):
    """encoded_rows of JSONL `lines` (blank lines skipped; errors name `name`:line)."""
    from zerotrain.train.data.records import jsonl_rows
    return encoded_rows(jsonl_rows(lines, name, "sft", HINT), enc, formats)


def truncated_away(where: str, seq_len: int) -> DataError:
    return DataError(f"{where}: the response is empty after truncation to data.seq_len {seq_len} "
                     f"(the record's prompt fills it); raise data.seq_len or shorten the prompt")


def open_jsonl(path: Path):
    try:
        return open(path, "rb")
    except OSError as e:
        raise DataError(f"data.path {path}: cannot read it ({e.strerror})") from None


class _Collect:
    """Records appended as flat typed arrays (8 + 1 bytes a token, not Python lists of ints)."""

    def __init__(self, seq_len: int, enc: Encoder):
        import array
        self.wide = enc.vocab_size > 2 ** 31
        self.seq_len, self.pad, self.offsets = seq_len, enc.pad, [0]
        self.ids, self.trained = array.array("q" if self.wide else "i"), array.array("b")

    def add(self, ids: list[int], trained: list[bool], where) -> None:
        ids, trained = ids[:self.seq_len + 1], trained[:self.seq_len + 1]
        if first_label(trained) >= len(trained):  # the first token is never a label
            raise truncated_away(where(), self.seq_len)
        self.ids.extend(ids)
        self.trained.extend(trained)
        self.offsets.append(len(self.ids))

    def done(self) -> SFTSequences:
        return SFTSequences(np.frombuffer(self.ids, dtype=np.int64 if self.wide else np.int32),
                            np.frombuffer(self.trained, dtype=np.bool_),  # 0/1 bytes
                            np.asarray(self.offsets, dtype=np.int64), self.seq_len, self.pad)


def read_records(path: Path, enc: Encoder, seq_len: int, formats: Optional[set] = None) -> SFTSequences:
    """Every record of a JSONL file, tokenized and truncated to seq_len + 1 tokens."""
    out = _Collect(seq_len, enc)
    with open_jsonl(path) as f:
        for lineno, ids, trained in encoded_records(f, path, enc, formats):
            out.add(ids, trained, lambda: f"{path}:{lineno}")
    if len(out.offsets) == 1:
        raise DataError(f"data.path {path} holds no records; data.kind sft needs JSONL records")
    return out.done()


def read_table(table, enc: Encoder, seq_len: int, formats: Optional[set] = None) -> SFTSequences:
    """Every row of a `datasets` table (train/data/records.py), as read_records reads JSONL."""
    from zerotrain.train.data.records import table_format, table_rows
    fmt = table_format(table, "sft")
    out = _Collect(seq_len, enc)
    for row, ids, trained in encoded_rows(table_rows(table, fmt), enc, formats):
        out.add(ids, trained, lambda: table.where(row))
    if len(out.offsets) == 1:
        raise DataError(f"data.path {table.name} holds no rows; data.kind sft needs records")
    return out.done()


def subset(seqs: SFTSequences, start: int, stop: int) -> SFTSequences:
    """Records [start, stop) of `seqs` (views of its arrays)."""
    o = seqs.offsets[start:stop + 1]
    return SFTSequences(seqs.ids[o[0]:o[-1]], seqs.trained[o[0]:o[-1]], o - o[0], seqs.seq_len, seqs.pad)


def val_path(path: Path) -> Path:
    return path.with_suffix(".val.jsonl")


def read_prepared(path: Path, enc: Encoder, seq_len: int) -> tuple[SFTSequences, dict]:
    """A set from `zerotrain prepare --sft` (train/data/sft_file.py), memory-mapped: the same
    samples as read_records on its source JSONL, provided it was tokenized the way this run
    would tokenize (the same tokenizer content and chat-template use; else refused)."""
    prep = sft_file.read(path)
    meta, fix = prep.meta, f"re-run `zerotrain prepare --sft {prep.meta['source']['path']} --out {path}`"
    if meta["tokenizer_sha256"] != enc.identity():
        raise DataError(f"{path} was prepared with tokenizer {meta['tokenizer']}, this run tokenizes with {enc.name} "
                        f"(a different tokenizer); {fix}{'' if enc.name == 'bytes' else ' --tokenizer ' + enc.name}, or set "
                        f"data.tokenizer to the one it was prepared with")
    if meta["chat_template"] != (enc.render is not None):
        raise DataError(f"{path} was prepared {'with' if meta['chat_template'] else 'without'} the chat template, "
                        f"this run renders records {'with' if enc.render else 'without'} it (data.chat_template "
                        f"{'true' if enc.render else 'false'}); {fix}{'' if enc.render else ' --no-chat-template'}"
                        f" or set data.chat_template {'true' if meta['chat_template'] else 'false'}")
    lengths = np.diff(prep.offsets)
    bad = np.flatnonzero((prep.index[:, 1] > seq_len) | (prep.index[:, 1] >= lengths))  # no label left in seq_len + 1
    if len(bad):
        raise truncated_away(f"{meta['source']['path']}:{int(prep.index[bad[0], 0])}", seq_len)
    return SFTSequences(prep.ids, prep.trained, prep.offsets, seq_len, enc.pad), meta


def _jsonl_sets(path: Path, enc: Encoder, seq_len: int, formats: set):
    """(records, sibling validation records or None, its name, largest id, what) from JSONL."""
    records, val_file = read_records(path, enc, seq_len, formats), val_path(path)
    val = read_records(val_file, enc, seq_len) if val_file.is_file() and val_file != path else None
    top = max(int(records.ids.max()), int(val.ids.max()) if val is not None else 0)
    return records, val, val_file.name, top, "instruction data"


def _source_sets(spec: str, enc: Encoder, seq_len: int, formats: set, subset=None, split=None):
    """The same from a `datasets` table, a Hub dataset id or a glob of JSONL files (train/data/records.py)."""
    from zerotrain.train.data.records import open_source
    src = open_source(spec, "sft", subset, split)
    if src.is_table:
        records = read_table(src.table, enc, seq_len, formats)
        val = read_table(src.val_table, enc, seq_len) if src.val_table is not None else None
    else:
        parts = [read_records(f, enc, seq_len, formats) for f in src.jsonl]
        records, val = (parts[0] if len(parts) == 1 else concat(parts)), None
    top = max(int(records.ids.max()), int(val.ids.max()) if val is not None else 0)
    return records, val, src.val_name, top, "instruction data"


def _local_only(cfg) -> None:
    """data.subset / data.split are read for Hub dataset ids and save_to_disk directories only."""
    for key in ("subset", "split"):
        if getattr(cfg, key) is not None:
            raise DataError(f"data.{key} {getattr(cfg, key)}: data.path {cfg.path} is a single file, without "
                            f"subsets or splits; remove data.{key}")


def concat(parts: list[SFTSequences]) -> SFTSequences:
    """Records of several files, in order."""
    starts = np.cumsum([0] + [len(p.ids) for p in parts[:-1]])
    offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, starts)])
    return SFTSequences(np.concatenate([p.ids for p in parts]), np.concatenate([p.trained for p in parts]),
                        offsets, parts[0].seq_len, parts[0].pad)


def _prepared_sets(path: Path, enc: Encoder, seq_len: int, formats: set):
    """The same from a prepared set: counts come from its sidecar, no token is read."""
    (records, meta), val_file, val_meta = read_prepared(path, enc, seq_len), sft_file.val_path(path), {}
    val = None
    if val_file.is_file():
        val, val_meta = read_prepared(val_file, enc, seq_len)
    top = max(meta["max_token"], val_meta.get("max_token", 0))
    return records, val, val_file.name, top, f"prepared instruction data (from {Path(meta['source']['path']).name})"


def build_sft(cfg: SftData, seq_len: Optional[int], tokenizer: Optional[str], seed: int = 0) -> DataBundle:
    """`tokenizer`: a local Hugging Face tokenizer directory, or None for bytes. data.path is a
    JSONL file, or a .bin set from `zerotrain prepare --sft` (the same samples, memory-mapped).
    data.packing: the samples are rows of packed records (train/data/packing.py), planned from
    `seed` and the record lengths."""
    if cfg.path is None:
        raise DataError('data.kind = sft needs data.path (a .jsonl, .parquet or .arrow file or glob, a save_to_disk '
                        'directory, or a .bin set from `zerotrain prepare --sft`)')
    if seq_len is None:
        raise DataError("data.kind = sft needs data.seq_len (the model has no context length to default to)")
    from zerotrain.train.data.records import is_table_spec
    path = Path(cfg.path).expanduser()
    table = is_table_spec(cfg.path)
    if not table and not path.is_file():
        raise DataError(f'data.path {path} does not exist (data.kind = sft expects a .jsonl, .parquet or .arrow file '
                        f'or glob of records ({HINT}), a save_to_disk directory, or a .bin set from '
                        f'`zerotrain prepare --sft`)')
    enc = hf_encoder(tokenizer, cfg.chat_template) if tokenizer else byte_encoder()
    sets = _prepared_sets if path.suffix == ".bin" else _source_sets if table else _jsonl_sets
    formats: set = set()
    if sets is _source_sets:
        records, sibling, val_name, top, what = sets(cfg.path, enc, seq_len, formats, cfg.subset, cfg.split)
    else:
        _local_only(cfg)
        records, sibling, val_name, top, what = sets(path, enc, seq_len, formats)
    if sibling is not None:
        train, val, split = records, sibling, f"val: {val_name}"
    else:
        n_val = int(len(records) * cfg.val_fraction)
        train, val = subset(records, 0, len(records) - n_val), (subset(records, len(records) - n_val, len(records))
                                                                 if n_val else None)
        split = f"val: last {n_val} records" if n_val else "no validation"
    fmt = "chat template" if enc.render else "plain format"
    n_records, layout = len(train), (f"padded to {seq_len}" if cfg.pad_to == "seq_len" else
                                     f"padded to each batch's longest record (a multiple of {PAD_MULTIPLE}, "
                                     f"at most {seq_len})")
    if cfg.packing:
        from zerotrain.train.data.packing import PackedSFT
        train, val = PackedSFT(train, seed), PackedSFT(val, seed) if val is not None else None
        layout = (f"packed into {len(train)} rows of {seq_len} ({1 - train.row_tokens.sum() / (len(train) * seq_len):.1%}"
                  f" padding)")
    counted = ""
    if sets is not _prepared_sets:  # in memory: cheap to count (a prepared set's tokens are not read here)
        recs = train.records if cfg.packing else train
        labelled = int(recs.trained.sum()) - int(recs.trained[recs.offsets[:-1]].sum())  # first tokens: inputs only
        counted = f", {labelled} response tokens"
    return DataBundle(train=train, val=val, task="lm", items_per_sample=seq_len, vocab_size=enc.vocab_size,
                      seq_len=seq_len, decode=enc.decode, masked_labels=True,
                      describe=f"{what} {cfg.path} ({n_records} records{counted}, "
                               f"{'format ' + ', '.join(sorted(formats)) + ', ' if formats else ''}"
                               f"{'bytes' if enc.name == 'bytes' else 'tokenizer ' + enc.name} {fmt}, {layout}; "
                               f"{split})",
                      extra={"max_token": top, "token_file": str(path), "tokenizer": enc.name,
                             "formats": sorted(formats), "packed": "data.packing" if cfg.packing else None,
                             "pad_to": None if cfg.packing else cfg.pad_to, "layout": layout})
