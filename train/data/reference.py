"""Precomputed reference log-probabilities of preference pairs (train.dpo.reference precomputed).

`zerotrain prepare --reference --config run.yaml` (train/commands/prepare.py) runs the run's model
at its starting weights over every record of data.path (and of its sibling <name>.val.jsonl) once
and writes, beside each file, <name>.reference.safetensors:

    lines           int64 (N,)   the record's line number in the JSONL file: the key
    chosen_logps    fp32  (N,)   log ref(chosen | prompt), summed over the response tokens
    rejected_logps  fp32  (N,)   log ref(rejected | prompt)

and, as the file's metadata, what the numbers depend on: the JSONL file's size and sha256, the
tokenizer (by content) and chat-template setting, data.seq_len (truncation), model.name,
train.seed, and how the model computes ("compute": the run's strategy file's precision and
backend form, Strategy.compute_form, e.g. "fp32" or "bf16 autocast with fp32 outputs (ddp) on
cpu"). The log-probs are computed the way the run's policy computes its own at step 1
(Strategy.frozen_like_policy), so in bf16 the step-1 rewards are exactly 0 as with the live
reference; fp32 is one form under every backend. The key is the line number, not a rank's or a
split's position, so any number of ranks, any validation split and any order read the same
values. A run with train.dpo.reference precomputed checks every one of those against its own and
refuses a file that differs (one line naming the file, what changed, and the command that
remakes it). A file from before "compute" was recorded was computed in fp32, and is read as such.
(The token counts are not stored: sigmoid and ipo need none, simpo needs no reference.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from zerotrain.train.errors import DataError

FORMAT = "zerotrain-dpo-reference"


def reference_path(source: Path) -> Path:
    """d.jsonl -> d.reference.safetensors (d.val.jsonl -> d.val.reference.safetensors)."""
    return source.with_name(source.stem + ".reference.safetensors")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def identity(source: Path, tokenizer_sha256: str, chat_template: bool, seq_len: int, model: str,
             seed: int, compute: str | None) -> dict[str, str]:
    """What a file of reference log-probs depends on (its safetensors metadata, all strings);
    `compute`: how the model computes (Strategy.compute_form; None leaves it out: a run reads the
    file with its data, before its strategy exists, and checks it with check_compute then)."""
    meta = {"format": FORMAT, "version": "1", "source_size": str(source.stat().st_size),
            "source_sha256": sha256_file(source), "tokenizer_sha256": tokenizer_sha256,
            "chat_template": json.dumps(bool(chat_template)), "seq_len": str(seq_len), "model": model,
            "seed": str(seed)}
    return meta if compute is None else {**meta, "compute": compute}


WHAT = {"source_size": "the data file's size", "source_sha256": "the data file's content (sha256)",
        "tokenizer_sha256": "the tokenizer", "chat_template": "data.chat_template", "seq_len": "data.seq_len",
        "model": "model.name", "seed": "train.seed", "format": "the format", "version": "the format version",
        "compute": "how the model computes (Strategy.compute_form)"}

#: what a file written before a key was recorded holds for it: "compute" came later, and every
#: file before it was computed in fp32
BEFORE = {"compute": "fp32"}


def write(path: Path, lines: np.ndarray, chosen: np.ndarray, rejected: np.ndarray, meta: dict[str, str]) -> None:
    """Atomically: a crash leaves the old file or none, never half a file."""
    import torch

    from zerotrain.train.checkpoint.files import save_file  # the run's file mode, not safetensors' 0600
    tmp = path.with_name(path.name + ".tmp")
    save_file({"lines": torch.from_numpy(np.ascontiguousarray(lines, dtype=np.int64)),
               "chosen_logps": torch.from_numpy(np.ascontiguousarray(chosen, dtype=np.float32)),
               "rejected_logps": torch.from_numpy(np.ascontiguousarray(rejected, dtype=np.float32))},
              tmp, meta)
    tmp.replace(path)


def partial_path(out: Path) -> Path:
    """Where `zerotrain prepare --reference` keeps the records done so far (resumable)."""
    return out.with_name(out.name.removesuffix(".safetensors") + ".partial.safetensors")


def read_partial(path: Path, expected: dict[str, str], lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (chosen, rejected) log-probs a partial file holds for the first records of `lines`, or two
    empty arrays when there is none or it was made for other data, tokenizer, model or seed."""
    empty = np.zeros(0, np.float32)
    if not path.is_file():
        return empty, empty
    from safetensors import safe_open
    try:
        with safe_open(str(path), "np") as f:
            if dict(f.metadata() or {}) != expected:
                return empty, empty
            done = f.get_tensor("lines")
            if len(done) > len(lines) or not np.array_equal(done, lines[:len(done)]):
                return empty, empty
            return f.get_tensor("chosen_logps"), f.get_tensor("rejected_logps")
    except Exception:  # noqa: BLE001 - unreadable: start over (the final file is written atomically)
        return empty, empty


def read_meta(path: Path) -> dict[str, str]:
    from safetensors import safe_open
    with safe_open(str(path), "np") as f:
        return dict(f.metadata() or {})


def _command(strategy: str | None) -> str:
    """The command that makes the file for this run (`strategy`: its strategy file, when known)."""
    return f"zerotrain prepare --reference --config <this run's file> --strategy {strategy or '<its strategy file>'}"


def _compute_differs(path: Path, have: str, want: str, strategy: str | None) -> DataError:
    return DataError(f"train.dpo.reference precomputed: {path} was computed in {have}, but this run computes in "
                     f"{want}{f' ({strategy})' if strategy else ''}, so its reference would not be the step-1 "
                     f"policy; re-run `{_command(strategy)}`")


def check_compute(source: Path, want: str, strategy: str) -> None:
    """The reference file of `source` (already read by load) was computed in the form `want`
    (Strategy.compute_form of the run's `strategy` file); DataError, one line, if not."""
    path = reference_path(source)
    have = read_meta(path).get("compute", BEFORE["compute"])
    if have != want:
        raise _compute_differs(path, have, want, strategy)


def load(source: Path, expected: dict[str, str], lines: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(chosen, rejected) reference log-probs of the records at JSONL `lines` of `source`, from
    its reference file once checked against `expected` (identity()); DataError, one line, if it
    is missing, stale or lacks a record."""
    path = reference_path(source)
    command = _command(None)
    remake = f"re-run `{command}`"
    if not path.is_file():
        raise DataError(f"train.dpo.reference precomputed: {path} does not exist (the reference log-probs of "
                        f"{source}); make it with `{command}`")
    try:
        meta = read_meta(path)
        from safetensors.numpy import load_file
        t = load_file(str(path))
        keys, chosen, rejected = t["lines"], t["chosen_logps"], t["rejected_logps"]
    except Exception as e:  # noqa: BLE001 (a damaged file: one line)
        raise DataError(f"train.dpo.reference precomputed: {path} is not a reference file ({type(e).__name__}: "
                        f"{str(e)[:120]}); {remake}") from None
    for k, want in expected.items():
        have = meta.get(k, BEFORE.get(k))
        if have != want:
            raise DataError(f"train.dpo.reference precomputed: {path} is stale: {WHAT.get(k, k)} differs (file "
                            f"{str(have)[:16]}, run {want[:16]}); {remake}")
    index = {int(n): i for i, n in enumerate(keys)}
    missing = [int(n) for n in lines if int(n) not in index]
    if missing:
        raise DataError(f"train.dpo.reference precomputed: {path} has no entry for {source}:{missing[0]} "
                        f"({len(missing)} record(s) missing); {remake}")
    at = np.asarray([index[int(n)] for n in lines], dtype=np.int64)
    return chosen[at].astype(np.float32), rejected[at].astype(np.float32)
