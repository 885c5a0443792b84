"""Files of a checkpoint: crash-safe directories, the manifest, flat tensor pieces, RNG.

Layout of one resumable checkpoint (`<run_dir>/checkpoints/step_00000120/`):

    manifest.json                         written last: every file's size and sha256
    meta.json                             step, data position, parameter shapes, config ...
    rank00000-00001-of-00002.safetensors  this rank's pieces, split at max_shard_size
    rng/rank00000.json                    each rank's python / numpy / torch / cuda RNG

A *piece* is a contiguous range of one flattened tensor, stored under the key
``"<kind>/<name>@<start>"`` (kind: param | exp_avg | exp_avg_sq | buffer). Which rank
wrote which range follows from how that run was partitioned; a reader only needs the
union of pieces to cover what it asks for, so any world size or ZeRO stage can read it.
Nothing here unpickles: tensors are safetensors, everything else JSON.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
from contextlib import ExitStack
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from zerotrain.train.errors import CheckpointError
from zerotrain.train.process_group import exists as process_group_exists

# The AdamW moments a checkpoint keeps per parameter (the strategy's holders read and write them).
MOMENTS = ("exp_avg", "exp_avg_sq")


def persistent_buffers(model) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong to the model's state (BatchNorm statistics), not derived ones (RoPE tables)."""
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is None or name in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out


FORMAT = "zerotrain-checkpoint"
# 2: meta.json keeps registered components' state as {"state": {name: state_dict}}; version 1
# had the engine's counters and fp16 scaler at its top level ("engine", "loss_scaler"), which
# component_states() still reads.
VERSION = 2
MANIFEST = "manifest.json"
META = "meta.json"
LATEST = "latest"
STEP_DIR = re.compile(r"step_(\d{8})")
TMP_PREFIX = ".tmp-"
_CHUNK = 8 << 20


# ---------------------------------------------------------------------------- durable writes

def fsync_path(path: Path):
    """Flush a file or directory entry to stable storage (a rename is durable only once its
    directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_record(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def write_json(path: Path, obj) -> dict:
    """Write, fsync, and return the manifest record of a JSON file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return file_record(path)


def replace_text(path: Path, text: str):
    """Atomically replace a small file (write aside, fsync, rename, fsync the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> dict:
    write_safetensors(tensors, path, {"format": "pt", **(metadata or {})})
    fsync_path(path)
    return file_record(path)


@lru_cache(maxsize=1)
def process_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (/proc/self/status),
    else set and restored once (cached: the save threads never race on it)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_file(tensors: dict[str, torch.Tensor], path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file with the file mode every other file of the run gets (0666 less
    the process umask: 0644 under umask 022). safetensors writes a private temporary file
    (mode 0600) and renames it into place, so without this another account on a shared
    cluster could not resume, import or export from the checkpoint."""
    from safetensors.torch import save_file as st_save_file
    st_save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~process_umask())


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """safetensors' save_file, with the same bytes for the same tensors and metadata. save_file
    writes the header's "__metadata__" in the order of a Rust HashMap, seeded afresh for every
    map: two exports of the same weights differed in that order alone. The header is rewritten
    in place with the metadata keys sorted (the same JSON, so the same length)."""
    save_file(tensors, path, metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size)
        header = json.loads(raw)
        if len(header.get("__metadata__") or {}) < 2:
            return
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) != len(raw.rstrip(b" ")):
            return  # not the compact JSON this expects: keep safetensors' own header
        f.seek(8)
        f.write(text.ljust(size, b" "))


# ---------------------------------------------------------------------------- finding checkpoints

def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, dir) of every checkpoint under `root` that has its manifest, oldest first.
    A save interrupted at any moment leaves only a `.tmp-*` directory, never a step dir."""
    found = []
    if root.is_dir():
        for d in root.iterdir():
            m = STEP_DIR.fullmatch(d.name)
            if m and (d / MANIFEST).is_file():
                found.append((int(m.group(1)), d))
    return sorted(found)


def newest_checkpoint(root: Path) -> Path | None:
    """What `--resume auto` continues from: the checkpoint `latest` names (the last one this
    run wrote, even if a later step survives from an abandoned attempt), else the newest
    complete one (a crash between the rename and the `latest` update)."""
    latest = root / LATEST
    if latest.is_file():
        name = latest.read_text().strip()
        if STEP_DIR.fullmatch(name) and (root / name / MANIFEST).is_file():
            return root / name
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir, or a run dir / checkpoints dir (then its newest complete checkpoint)."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if p.name.startswith(TMP_PREFIX) or (p.is_dir() and STEP_DIR.fullmatch(p.name)):
        raise CheckpointError(f"checkpoint {p} is incomplete (no {MANIFEST}: the save was interrupted); "
                              f"resume from an older one, or use --resume auto to pick the newest complete one")
    for root in (p / "checkpoints", p):
        found = newest_checkpoint(root)
        if found:
            return found
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist; pass a checkpoint directory "
                              f"(e.g. runs/x/checkpoints/step_00000100), a run directory, or --resume auto")
    raise CheckpointError(f"no complete checkpoint in {p}: expected a directory with {MANIFEST} "
                          f"(e.g. runs/x/checkpoints/step_00000100)")


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is damaged (not valid JSON: {e})") from None


def read_manifest(ckpt: Path) -> dict:
    m = read_json(ckpt / MANIFEST, "checkpoint manifest")
    if m.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt} is not a zerotrain checkpoint ({MANIFEST} has format {m.get('format')!r})")
    if m.get("version", 0) > VERSION:
        raise CheckpointError(f"{ckpt} was written by a newer zerotrain (format version {m['version']} > {VERSION}); "
                              f"upgrade zerotrain to load it")
    return m


def component_states(meta: dict) -> dict:
    """{component name: its saved state} of a meta.json: its "state" section (version 2), or the
    same records where version 1 (and `zerotrain import` before version 2) kept them: the
    strategy's engine counters and fp16 loss scaler at the top level."""
    if "state" in meta:
        return meta["state"] or {}
    return {"engine": {"counters": meta.get("engine"), "loss_scaler": meta.get("loss_scaler")}}


def check_file(ckpt: Path, name: str, rec: dict) -> str | None:
    """None if the file matches its manifest record, else what is wrong with it."""
    path = ckpt / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != rec["size"]:
        return f"{path} has {size} bytes, the manifest says {rec['size']} (truncated or overwritten)"
    if sha256_file(path) != rec["sha256"]:
        return f"{path} does not match its sha256 checksum in {MANIFEST} (the file is damaged)"
    return None


def damaged_error(ckpt: Path, problems: list[str]) -> CheckpointError:
    more = f" (and {len(problems) - 1} more damaged files)" if len(problems) > 1 else ""
    return CheckpointError(f"checkpoint {ckpt} is damaged: {problems[0]}{more}; resume from an older checkpoint "
                           f"in {ckpt.parent} (or delete this one and use --resume auto)")


def remove_tree(path: Path):
    shutil.rmtree(path, ignore_errors=True)


def replace_dir(tmp: Path, out: Path):
    """Move a completely written directory into place; the previous one is removed only after
    the rename, so a crash at any point leaves one complete directory (new, or old under
    .<name>.old)."""
    fsync_path(tmp)
    old = out.with_name(f".{out.name}.old")
    remove_tree(old)
    if out.exists():
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_path(out.parent)
    remove_tree(old)


# ---------------------------------------------------------------------------- pieces

def piece_key(kind: str, name: str, start: int) -> str:
    return f"{kind}/{name}@{start}"


def parse_piece_key(key: str) -> tuple[str, str, int]:
    kind, rest = key.split("/", 1)
    name, start = rest.rsplit("@", 1)
    return kind, name, int(start)


class PieceReader:
    """Reads any range of any flattened tensor from a set of safetensors files, opening
    only the headers up front and then only the bytes asked for (safetensors slices are
    memory-mapped), so a rank never holds more than the range it needs."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open
        self._stack = ExitStack()
        self._handles = {}
        self.index: dict[tuple[str, str], list[tuple[int, int, Path, str]]] = {}
        for path in files:
            try:
                h = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as e:  # safetensors raises its own error types for bad headers
                self.close()
                raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
            self._handles[path] = h
            for key in h.keys():
                kind, name, start = parse_piece_key(key)
                numel = int(np.prod(h.get_slice(key).get_shape()))
                self.index.setdefault((kind, name), []).append((start, start + numel, path, key))
        for pieces in self.index.values():
            pieces.sort()

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.index

    def read(self, kind: str, name: str, start: int, stop: int, dtype=torch.float32) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor (1-D, converted to `dtype`)."""
        out = torch.empty(stop - start, dtype=dtype)
        covered, hole_end = start, stop
        for a, b, path, key in self.index.get((kind, name), []):
            lo, hi = max(a, covered), min(b, stop)
            if lo > covered:
                hole_end = min(a, stop)
                break
            if hi <= lo:
                continue
            out[lo - start:hi - start] = self._handles[path].get_slice(key)[lo - a:hi - a].to(dtype)
            covered = hi
            if covered >= stop:
                break
        if covered < stop:
            raise CheckpointError(f"the checkpoint has no data for elements [{covered}, {hole_end}) of {kind} {name} "
                                  f"(a rank's file is missing from the manifest?)")
        return out

    def close(self):
        self._stack.close()


# ---------------------------------------------------------------------------- RNG

def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_file(rank: int) -> str:
    """Where in a checkpoint rank `rank`'s RNG streams are."""
    return f"rng/rank{rank:05d}.json"


def rng_state() -> dict:
    """This process's RNG streams as JSON (dropout masks, augmentation, sampling)."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {"python": [py_version, list(py_state), py_gauss],
           "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_gauss)],
           "torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(s: dict):
    v, state, gauss = s["python"]
    random.setstate((v, tuple(state), gauss))
    name, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(s["torch"]))
    if torch.cuda.is_available() and s.get("cuda"):
        states = [_unb64(x) for x in s["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


# ---------------------------------------------------------------------------- verification (collective when world > 1)

def process_group():
    return torch.distributed if process_group_exists() else None


def barrier():
    """Every rank waits for the others (nothing alone)."""
    d = process_group()
    if d is not None:
        d.barrier()


def reduce_max(t: torch.Tensor, device) -> torch.Tensor:
    d = process_group()
    if d is None:
        return t
    t = t.to(device)
    d.all_reduce(t, op=d.ReduceOp.MAX)
    return t.cpu()


def verify(ckpt: Path, manifest: dict, rank: int = 0, world: int = 1, device="cpu"):
    """Check every file against the manifest (size, sha256) before anything is loaded. Ranks
    split the hashing, then agree on which files are damaged; the error names them."""
    names = sorted(manifest["files"])
    if META not in names:
        raise damaged_error(ckpt, [f"{MANIFEST} does not list {META}"])
    bad, why = torch.zeros(len(names), dtype=torch.int32), {}
    for i, n in enumerate(names):
        if i % world == rank:
            problem = check_file(ckpt, n, manifest["files"][n])
            if problem:
                bad[i], why[i] = 1, problem
    bad = reduce_max(bad, device) if world > 1 else bad
    problems = [why.get(i, f"{ckpt / names[i]} failed verification (size or checksum)")
                for i in range(len(names)) if bad[i]]
    if problems:
        raise damaged_error(ckpt, problems)
