"""Read a W&B offline run file (``run-<id>.wandb``) back without network or the wandb CLI.

W&B 0.31 ships no offline reader (``wandb sync --view`` and ``wandb.sdk.internal.datastore``
are gone; docs/observability.md "Reading an offline W&B run
without network"). The file is a LevelDB-style log:

    header   ":W&B" | uint16 LE 0xBEE1 | uint8 version 0            (7 bytes)
    blocks   32 KiB each, counted from the start of the file (header included)
    record   crc32 uint32 LE | length uint16 LE | type uint8 | payload[length]
             type 1 = full, 2 = first, 3 = middle, 4 = last fragment of one message;
             crc32 covers the type byte then the payload;
             a block tail shorter than a record header (7 bytes) is zero padding.

Joined payloads are ``wandb.proto.wandb_internal_pb2.Record`` messages. A run that is still
writing, or was killed, ends in a torn record: the reader stops there and returns what came before.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32 * 1024
REC_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def iter_payloads(data: bytes) -> Iterator[bytes]:
    """Yield each complete message payload; stop silently at a torn or corrupt tail."""
    if data[:len(HEADER)] != HEADER:
        raise ValueError(f"not a W&B run file (header {data[:len(HEADER)]!r})")
    pos, parts = len(HEADER), None
    while True:
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < REC_HEADER:  # padding up to the next block
            pos += left_in_block
            continue
        if pos + REC_HEADER > len(data):
            return
        crc, length, rtype = struct.unpack_from("<IHB", data, pos)
        start, end = pos + REC_HEADER, pos + REC_HEADER + length
        if length > left_in_block - REC_HEADER or end > len(data):
            return  # torn: the record claims more bytes than were written
        payload = data[start:end]
        if zlib.crc32(bytes([rtype]) + payload) & 0xFFFFFFFF != crc:
            return  # torn or zero-filled tail
        pos = end
        if rtype == FULL and parts is None:
            yield payload
        elif rtype == FIRST and parts is None:
            parts = [payload]
        elif rtype == MIDDLE and parts is not None:
            parts.append(payload)
        elif rtype == LAST and parts is not None:
            yield b"".join(parts + [payload])
            parts = None
        else:
            return  # fragment out of sequence: treat as corruption


def iter_records(path: str | Path):
    from wandb.proto import wandb_internal_pb2
    for payload in iter_payloads(Path(path).read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        yield rec


def _item_value(item):
    """History/summary/config items carry JSON text (value_json); newer writers may use typed fields."""
    if item.value_json:
        return json.loads(item.value_json)
    kind = item.WhichOneof("value") if any(o.name == "value" for o in item.DESCRIPTOR.oneofs) else None
    return getattr(item, kind) if kind else None


def _item_key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class OfflineRun:
    run_ids: list[str] = field(default_factory=list)   # one per "run" record (resume writes another file)
    project: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    group: str = ""
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # one dict per row, with "_step"
    summary: dict = field(default_factory=dict)
    preempting: bool = False
    exit_code: int | None = None


def read_run(path: str | Path) -> OfflineRun:
    out = OfflineRun()
    for rec in iter_records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            out.run_ids.append(r.run_id)
            out.project, out.name, out.group = r.project, r.display_name, r.run_group
            out.tags = list(r.tags)
            for item in r.config.update:
                out.config[_item_key(item)] = _item_value(item)
        elif kind == "config":
            for item in rec.config.update:
                out.config[_item_key(item)] = _item_value(item)
        elif kind == "history":
            row = {_item_key(i): _item_value(i) for i in rec.history.item}
            if rec.history.HasField("step") and "_step" not in row:
                row["_step"] = rec.history.step.num
            out.history.append(row)
        elif kind == "summary":
            for item in rec.summary.update:
                out.summary[_item_key(item)] = _item_value(item)
        elif kind == "preempting":
            out.preempting = True
        elif kind == "exit":
            out.exit_code = rec.exit.exit_code
    return out


def run_files(wandb_root: str | Path) -> list[Path]:
    """Every offline run file under a W&B directory (``<dir>/wandb/offline-run-*/run-*.wandb``),
    oldest first (by last write: a resume's "...-<id>-1" directory may sort before "...-<id>")."""
    return sorted(Path(wandb_root).glob("**/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime_ns)


# ---------------------------------------------------------------------------- the shared observed run
# test_wandb.py and test_observability.py assert on the same real 2-process launch (one
# launch per pytest session, whichever module asks first).

PEAK_FLOPS = 1e12  # --peak-flops: MFU is then computed on CPU too, against this peak
OBSERVED_ARGS = ["--logging.wandb.mode", "offline", "--logging.wandb.project", "zt-test",
                 "--logging.wandb.tags", "ci,zero2", "--logging.wandb.group", "obs",
                 "--train.max_steps", "6", "--train.eval_every", "3", "--peak-flops", str(PEAK_FLOPS),
                 "--checkpoint.save_at_end", "true"]
# A syntactically valid, fake key: it must never show up in any output or file.
FAKE_API_KEY = "0123456789abcdef0123456789abcdef01234567"
_OBSERVED: dict = {}


def wandb_env(home: Path) -> dict:
    """Keep every file W&B writes (settings, cache, staging) inside the test's tmp dirs."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(home / "config"),
            "WANDB_CACHE_DIR": str(home / "cache"), "WANDB_DATA_DIR": str(home / "data"),
            "WANDB_ARTIFACT_DIR": str(home / "artifacts"), "WANDB_API_KEY": FAKE_API_KEY}


def observed_run(tmp_path_factory):
    """(run_dir, CompletedProcess, args, env) of a 2-process ZeRO-2 fp32 run under torchrun
    with W&B offline; W&B files default to <run_dir>/wandb (WANDB_DIR unset)."""
    if "run" not in _OBSERVED:
        from helpers import TINY, fp32, run_train
        base = tmp_path_factory.mktemp("observed")
        run_dir, home = base / "run", base / "home"
        home.mkdir()
        args = [*TINY, "--ds-config", fp32(base, "zero2"), *OBSERVED_ARGS, "--train.run_dir", str(run_dir)]
        env = wandb_env(home)
        # torchrun: W&B under the deepspeed launcher (pdsh, two nodes) is tests/test_multinode.py's first run.
        proc = run_train("torchrun", 2, args, env=env, timeout=900)  # 2 cores shared: imports alone can take minutes
        _OBSERVED["run"] = (run_dir, proc, args, env)
    return _OBSERVED["run"]
