"""DeepSpeed's CPU all-reduce buffers in /dev/shm: released by their owners, stale ones swept.

DeepSpeed's CPU shm comm op (deepspeed/ops/csrc/cpu/comm/shm.cpp, shm_interface.cpp) runs when
every rank is on one machine (LOCAL_SIZE == world size: the deepspeed launcher sets LOCAL_SIZE;
torchrun does not). In `shm_initialize` each rank creates

    /dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>

(shm_open O_CREAT, ~66 MB, then mmap; its fds stay open), then opens and maps every other rank's
file by name, retrying while it does not exist yet (`do ... while (errno == ENOENT)`, no timeout).
Nothing ever unlinks them (`shared_close` is never called), so every such run left
2 x 66 MB behind, killed or not (measured: a successful 3-step deepspeed-launcher run).

Owners (`release_own_buffer`): once every rank has mapped every peer's file, the names are never
looked up again; unlinking a name that processes have mapped is safe on Linux (the memory lives
until the last mapping goes). "Every rank has mapped every file" holds after a collective that
follows DeepSpeed's comm initialisation on all ranks: train/training/assembly.py prepare() calls
this after `accelerator.prepare` (the engine exists: its comm backend was initialised) behind a
barrier, so no peer can still be in the ENOENT loop waiting for the name (it would spin forever). Each rank
unlinks only its own file. After that nothing is left to leak, whatever kills the job later
(SIGKILL included). Exits before that point (a user error right after the engine was built) run
`release_at_exit` (atexit), which unlinks the rank's own file only if this process has mapped
all world-size buffers.

Sweep (`sweep_stale`, at start-up on each node's local rank 0 (`sweep_at_start`), and by the test
suite at its end): removes a buffer file only when no running job can own it:
- its name has our uid and the file is ours;
- no process whose /proc we can read has it open (/proc/<pid>/fd) or mapped (/proc/<pid>/maps);
  processes we cannot read (e.g. /proc/1 in some containers) are not seen;
- nothing on this machine listens on the TCP port in its name: a live job's rendezvous store
  listens on MASTER_PORT, and the shm op only runs when all ranks, the store's included, are
  on this machine (/proc/net/tcp, tcp6);
- it is older than `min_age_s` (a margin on top of the rest: a creator holds its file open
  from the shm_open that creates it).
Even a mistaken removal would only cost memory accounting, not a job: a name matters only while
the job's ranks are still opening each other's files (its first seconds, which min_age_s covers);
after that, unlinking it is exactly what release_own_buffer does.
This module imports nothing heavy (the test suite's session hook imports it).
"""

from __future__ import annotations

import atexit
import os
import re
import time
from pathlib import Path
from typing import Optional

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"
_NAME = re.compile(rf"^{PREFIX}_(?P<uid>\d+)_(?P<addr>.*)_(?P<port>\d*)_(?P<rank>\d+)$")
_state = {"rank": None, "world": None}   # set when DeepSpeed's buffers are known to be in use here


def buffer_name(rank: int, addr: str, port: str, uid: Optional[int] = None) -> str:
    """The name shm.cpp gives rank `rank`'s buffer: "%s_%d_%s_%s" then "_%d"."""
    return f"{PREFIX}_{os.getuid() if uid is None else uid}_{addr}_{port}_{rank}"


def parse_name(name: str) -> Optional[dict]:
    m = _NAME.match(name)
    if not m:
        return None
    d = m.groupdict()
    return {"uid": int(d["uid"]), "addr": d["addr"], "port": int(d["port"]) if d["port"] else None,
            "rank": int(d["rank"])}


def mapped_buffers(pid: str = "self", proc: Path = Path("/proc")) -> set[Path]:
    """The DeepSpeed buffer files process `pid` maps (names still in the directory)."""
    try:
        text = (proc / str(pid) / "maps").read_text()
    except OSError:
        return set()
    out = set()
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and Path(parts[5]).name.startswith(PREFIX) and not parts[5].endswith("(deleted)"):
            out.add(Path(parts[5]))
    return out


def own_buffer(rank: int, env=os.environ, shm_dir: Path = SHM_DIR) -> Optional[Path]:
    """This rank's buffer if this process maps it: the name shm.cpp forms from the environment,
    else (an environment changed since) the mapped buffer whose rank suffix is ours and whose
    port is MASTER_PORT."""
    expected = shm_dir / buffer_name(rank, env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""))
    mine = mapped_buffers()
    if expected in mine:
        return expected
    port = env.get("MASTER_PORT", "")
    for p in sorted(mine):
        info = parse_name(p.name)
        if info and info["rank"] == rank and info["uid"] == os.getuid() and str(info["port"] or "") == port:
            return p
    return None


def in_use(world: int, comm_op: bool) -> bool:
    """Whether DeepSpeed's CPU shm all-reduce was initialised in this process (`comm_op`: the
    strategy's word, Strategy.uses_shm_buffers) with every rank on this machine (the same answer
    on every rank of a job: the same launcher environment and code path)."""
    return comm_op and world >= 2 and os.environ.get("LOCAL_SIZE") == str(world)


def release_own_buffer(rank: int, world: int, comm_op: bool, barrier=None) -> Optional[Path]:
    """Unlink this rank's buffer once every rank has mapped every peer's (see the module doc).
    `comm_op` as for in_use. `barrier` is called first (collective: every rank of the job must
    call this); returns the path unlinked, or None (no DeepSpeed buffer in this process)."""
    if not in_use(world, comm_op):
        return None
    _state.update(rank=rank, world=world)
    if barrier is not None:
        barrier()  # every peer is past shm_initialize: it has mapped this rank's file
    return _unlink_own(rank)


def _unlink_own(rank: int) -> Optional[Path]:
    path = own_buffer(rank)
    if path is None:
        return None
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    return path


def release_at_exit():
    """atexit: a rank leaving before release_own_buffer ran (a user error after the engine was
    built) unlinks its own buffer, if it has itself mapped all world-size buffers (it got past
    shm_initialize; its peers started before it, or the launcher stops them when it fails)."""
    rank = _state["rank"] if _state["rank"] is not None else _env_int("RANK")
    world = _state["world"] if _state["world"] is not None else _env_int("WORLD_SIZE")
    if rank is None or not world or os.environ.get("LOCAL_SIZE") != str(world):
        return
    port = os.environ.get("MASTER_PORT", "")
    job = [p for p in mapped_buffers() if (parse_name(p.name) or {}).get("port") == (int(port) if port else None)]
    if len(job) >= world:
        _unlink_own(rank)


def _env_int(key: str) -> Optional[int]:
    try:
        return int(os.environ[key])
    except (KeyError, ValueError):
        return None


# ---------------------------------------------------------------------------- the stale sweep

def listening_ports(proc: Path = Path("/proc")) -> set[int]:
    """TCP ports something on this machine (this network namespace) listens on."""
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 3 and f[3] == "0A":  # TCP_LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def holders(paths: set[Path], proc: Path = Path("/proc")) -> dict[Path, set[int]]:
    """Which readable processes have each of `paths` open or mapped."""
    found: dict[Path, set[int]] = {p: set() for p in paths}
    wanted = {str(p): p for p in paths}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        pid = int(d.name)
        try:
            for fd in os.scandir(d / "fd"):
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target in wanted:
                    found[wanted[target]].add(pid)
        except OSError:
            pass  # not ours to read, or gone
        for p in mapped_buffers(d.name, proc):
            if str(p) in wanted:
                found[wanted[str(p)]].add(pid)
    return found


def sweep_at_start() -> None:
    """At a rank's start, before DeepSpeed creates this job's buffers: those ended jobs left are
    removed by each node's local rank 0 when no running job can own them (`sweep_stale`), and this
    rank's own buffer is released at exit too (`release_at_exit`)."""
    atexit.register(release_at_exit)
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    removed = sweep_stale()
    if removed:
        print(f"zerotrain: removed {len(removed)} stale DeepSpeed shared-memory buffer(s) of ended jobs from "
              f"{removed[0].parent}", flush=True)


def sweep_stale(shm_dir: Path = SHM_DIR, min_age_s: float = 60.0, proc: Path = Path("/proc")) -> list[Path]:
    """Remove the DeepSpeed buffer files that no running job can own (rules: the module doc).
    Returns the removed paths."""
    uid = os.geteuid()
    now = time.time()
    candidates = []
    try:
        entries = list(shm_dir.iterdir())
    except OSError:
        return []
    for p in entries:
        info = parse_name(p.name)
        if info is None or info["uid"] != uid:
            continue
        try:
            st = p.lstat()
        except OSError:
            continue
        if st.st_uid != uid or now - st.st_mtime < min_age_s:
            continue
        candidates.append((p, info))
    if not candidates:
        return []
    listening = listening_ports(proc)
    candidates = [(p, i) for p, i in candidates if i["port"] is None or i["port"] not in listening]
    held = holders({p for p, _ in candidates}, proc)
    removed = []
    for p, _ in candidates:
        if held[p]:
            continue
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed
