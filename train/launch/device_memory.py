"""How much memory one rank may use, what it holds now, and host-allocator settings.

A rank's budget is what its device can give it:
  - CUDA: the free memory of its GPU (torch.cuda.mem_get_info), read before the model exists;
  - CPU (the device is host RAM): the tightest memory-cgroup limit over this process's cgroup
    and its ancestors (v1 memory.limit_in_bytes, v2 memory.max), shared by the ranks of this
    node inside that cgroup; and the RAM: what the rank holds now plus its share of
    MemAvailable. The kernel kills a process over its cgroup limit (SIGKILL, exit 137) with
    no message: zerotrain checks the plan against the budget first (train/plan/memory_check.py).

compact_host_malloc() makes glibc return freed large blocks to the OS at once, so that a CPU
rank's resident memory follows its live tensors; see its docstring for what it costs.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 62            # cgroup v1 writes "no limit" as a page-aligned 2^63 - 1
COMPACT_MMAP_THRESHOLD = 1 << 20


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def owned_bytes() -> int:
    """The resident memory this process alone holds and cannot give back: anonymous pages and
    shared memory it created (RssAnon + RssShmem). Its file-backed pages (the libraries' code, a
    large part of a rank's RSS after the imports) are shared with every process that maps them,
    charged to the cgroup that read them first and dropped under memory pressure: neither a cgroup limit
    nor the RAM pays for them per rank. Falls back to the RSS where /proc has no breakdown."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return sum(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssShmem"))
    except (OSError, KeyError, ValueError):
        return rss_bytes()


def mem_available() -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M)
    return int(m.group(1)) * 1024 if m else None


@dataclass(frozen=True)
class CgroupLimit:
    bytes: int
    path: str          # the cgroup (directory under /sys/fs/cgroup) that sets it


def _own_cgroups(proc_cgroup: str) -> list[tuple[str, Path]]:
    """(version, directory of this process's memory cgroup) from /proc/self/cgroup text."""
    out = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if "memory" in controllers.split(","):
            out.append(("v1", CGROUP_ROOT / "memory" / rel.lstrip("/")))
        elif controllers == "" and (CGROUP_ROOT / "cgroup.controllers").exists():
            out.append(("v2", CGROUP_ROOT / rel.lstrip("/")))
    return out


def _read_limit(version: str, d: Path) -> int | None:
    f = d / ("memory.limit_in_bytes" if version == "v1" else "memory.max")
    try:
        text = f.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return None if v >= UNLIMITED else v


def cgroup_limit(proc_cgroup: str | None = None) -> CgroupLimit | None:
    """The tightest memory limit over this process's cgroup and its ancestors, or None."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    best = None
    for version, d in _own_cgroups(proc_cgroup):
        root = CGROUP_ROOT / "memory" if version == "v1" else CGROUP_ROOT
        while True:
            v = _read_limit(version, d)
            if v is not None and (best is None or v < best.bytes):
                best = CgroupLimit(v, str(d))
            if d == root or root not in d.parents:
                break
            d = d.parent
    return best


@dataclass(frozen=True)
class Budget:
    """What one rank may use, and why (for messages)."""

    bytes: int
    source: str        # e.g. "the memory cgroup limit of /sys/fs/cgroup/memory/x (1 rank in it)"
    device: str        # "cpu" | "cuda"
    runtime: int       # bytes this rank holds before the model exists (owned_bytes() on CPU; 0 on CUDA)
    host_free: int | None = None  # host RAM this rank can still take (host_free()), the tightest rank's
    host_source: str = ""         # why, for messages


def local_ranks(environ=os.environ) -> int:
    """Ranks on this node, as the launcher that started us says, already before the Accelerator
    exists (the budget is measured then): torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher
    only LOCAL_SIZE (Accelerate sets LOCAL_WORLD_SIZE when it starts), mpirun OMPI_COMM_WORLD_LOCAL_SIZE."""
    for k in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if environ.get(k, "").strip().isdigit():
            return max(1, int(environ[k]))
    return 1


def host_free() -> tuple[int, str]:
    """Host RAM this rank can still take, and why: on a GPU machine a rank's pinned host buffers
    (checkpoint.async's snapshot) live there, outside the GPU budget. Its share of MemAvailable,
    or, under a tighter memory cgroup, its share of the limit less what it holds now."""
    ranks = local_ranks()
    avail = mem_available()
    free, why = (avail // ranks, f"MemAvailable / {ranks} local rank(s)") if avail is not None \
        else (1 << 60, "no /proc/meminfo: not limited")
    limit = cgroup_limit()
    if limit is not None and limit.bytes // ranks - owned_bytes() < free:
        free = max(0, limit.bytes // ranks - owned_bytes())
        why = f"the memory cgroup limit of {limit.path} / {ranks} local rank(s), less what this rank holds"
    return free, why


def local_budget() -> tuple[int, str, str | None, int]:
    """This rank's own view, before agreeing with the others: (bytes, why, the cgroup that
    limits it or None, runtime bytes the process holds now: owned_bytes() on CPU, 0 on CUDA)."""
    import torch
    from zerotrain.train.observe.report import human_bytes
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        return free, f"the free memory of {torch.cuda.get_device_name()} (of {human_bytes(total)})", None, 0
    owned = owned_bytes()
    avail = mem_available()
    ram = owned + (avail // local_ranks() if avail is not None else 1 << 60)
    limit = cgroup_limit()
    if limit is not None and limit.bytes < ram:
        return limit.bytes, f"the memory cgroup limit of {limit.path}", limit.path, owned
    return ram, "this rank's share of the available RAM (what it holds + MemAvailable / local ranks)", None, owned


def compact_host_malloc() -> bool:
    """glibc: serve every allocation of 1 MiB or more by its own mmap and unmap it when freed.

    By default glibc raises its mmap threshold as blocks are freed (up to 32 MiB), so most
    tensors come from the heap, and freed ones stay resident wherever live ones sit above
    them: a ZeRO-3 rank's peak is well above its live tensors. With a fixed 1 MiB threshold
    memory follows live tensors. Fresh pages cost page faults, which huge pages
    (THP_MEM_ALLOC_ENABLE, which the user may set before torch loads) mostly remove (measured:
    BENCHMARKS.md "Host allocator on CPU"). A threshold the user set (MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES) is left alone. Returns True if applied."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "mmap_threshold" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
    except (OSError, AttributeError):
        return False
    M_MMAP_THRESHOLD = -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, COMPACT_MMAP_THRESHOLD))
