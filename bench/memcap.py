"""Run a command under a memory limit the kernel enforces: a memory cgroup of its own, nested
under this process's cgroup (v1 memory.limit_in_bytes, or v2 memory.max where the parent
delegates the controller). A process over the limit is killed by the kernel (SIGKILL).

    python bench/memcap.py --limit 3.5GiB -- python train/main.py ...
    torchrun --nproc_per_node 2 bench/memcap.py --limit 3.5GiB --report-dir out -- train/main.py ...

One cgroup per rank under torchrun; --report-dir records each rank's peak as the kernel counts
it against the limit (anonymous and shared memory, page cache the rank read first; not the
shared library code other processes loaded before it, which its RSS includes).

The command runs in a child process that joins the new cgroup before it execs; this parent
stays outside (a few MiB), forwards SIGTERM/SIGINT, waits, removes the cgroup and exits with
the child's code (137 when the kernel killed it, with one line naming the limit on stderr).
Under torchrun the command is a script run with this interpreter (as torchrun would).
Needs root (or a delegated cgroup); `--check` only reports whether a limit can be set here.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", text, re.I)
    if not m:
        raise SystemExit(f"memcap: --limit {text!r} is not a size (e.g. 3.5GiB, 800MB)")
    power = "KMGT".index(m.group(2).upper()) + 1 if m.group(2) else 0
    base = 1024 if (m.group(3) or not m.group(0).upper().strip().endswith("B")) else 1000
    return int(float(m.group(1)) * base ** power)


def _own(proc_cgroup: str) -> tuple[str, Path] | None:
    for line in proc_cgroup.splitlines():
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            return "v1", ROOT / "memory" / rel.lstrip("/")
    for line in proc_cgroup.splitlines():
        _, controllers, rel = line.split(":", 2)
        if controllers == "" and (ROOT / "cgroup.controllers").exists():
            return "v2", ROOT / rel.lstrip("/")
    return None


class Cgroup:
    """A child memory cgroup of this process's own; removed by close()."""

    def __init__(self, limit: int, name: str):
        own = _own(Path("/proc/self/cgroup").read_text())
        if own is None:
            raise OSError("no memory cgroup controller is mounted")
        self.version, parent = own
        if self.version == "v2" and "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            raise OSError(f"cgroup v2: {parent} does not delegate the memory controller to children")
        self.path = parent / name
        self.path.mkdir()
        try:
            limit_file = "memory.limit_in_bytes" if self.version == "v1" else "memory.max"
            (self.path / limit_file).write_text(str(limit))
        except OSError:
            self.close()
            raise
        self.limit = limit

    def join(self, pid: int):
        (self.path / "cgroup.procs").write_text(str(pid))

    def oom_killed(self) -> bool:
        """Whether the kernel's OOM killer acted in this cgroup (v1 memory.oom_control, v2 memory.events)."""
        name = "memory.oom_control" if self.version == "v1" else "memory.events"
        try:
            m = re.search(r"^oom_kill (\d+)", (self.path / name).read_text(), re.M)
        except OSError:
            return False
        return bool(m) and int(m.group(1)) > 0

    def peak_usage(self) -> int | None:
        """The most memory the kernel charged to this cgroup (v1 max_usage_in_bytes, v2 memory.peak)."""
        try:
            return int((self.path / ("memory.max_usage_in_bytes" if self.version == "v1" else "memory.peak"))
                       .read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def close(self):
        try:
            self.path.rmdir()
        except OSError:
            pass


def can_cap() -> str | None:
    """None if a memory limit can be set here, else why not."""
    try:
        g = Cgroup(1 << 30, f"zerotrain-probe-{os.getpid()}")
    except OSError as e:
        return str(e)
    g.close()
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", help="memory limit, e.g. 3.5GiB")
    p.add_argument("--check", action="store_true", help="only say whether a limit can be set here")
    p.add_argument("--report-dir", help="write rank<RANK>.json there: limit, the cgroup's peak usage, exit, OOM kill")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.check:
        why = can_cap()
        print("ok" if why is None else f"memcap: cannot set a memory limit here: {why}")
        return 0 if why is None else 1
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not a.limit or not cmd:
        p.error("need --limit SIZE and a command after --")
    if cmd[0].endswith(".py"):  # a script, as torchrun passes it: run it with this interpreter
        cmd = [sys.executable, *cmd]
    limit = parse_size(a.limit)
    group = Cgroup(limit, f"zerotrain-cap-{os.getpid()}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: wait until it is inside the cgroup, then become the command
        os.close(w)
        os.read(r, 1)
        os.close(r)
        os.execvp(cmd[0], cmd)
    os.close(r)
    group.join(pid)
    os.write(w, b"x")
    os.close(w)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: os.kill(pid, s))
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    oom = killed and group.oom_killed()
    code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    if a.report_dir:
        import json
        Path(a.report_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.report_dir) / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(
            {"limit_bytes": limit, "peak_usage_bytes": group.peak_usage(), "exit": code, "oom_killed": oom}) + "\n")
    group.close()
    if oom:
        what = next((c for c in cmd if c.endswith(".py")), cmd[0])
        print(f"memcap: the kernel killed {what} (rank {os.environ.get('RANK', '?')}): over its memory limit of "
              f"{limit / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
