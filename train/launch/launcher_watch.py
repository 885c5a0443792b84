"""A SIGTERM to the single-node `deepspeed` launcher reaches the ranks.

`deepspeed --num_gpus N train/main.py` is two processes above the ranks: the `deepspeed` runner
(deepspeed/launcher/runner.py), which starts `python -m deepspeed.launcher.launch`, which starts
the ranks. The runner forwards SIGTERM/SIGINT only for a multi-node (pdsh) launch; on one node
it has no handler, so `kill <deepspeed pid>` (a scheduler's preemption of the command it
started) ends the runner alone, and the launch process and the ranks train on, orphaned.

Each rank of such a launch therefore watches the runner: a daemon thread reads, every
POLL_S seconds, the parent of its own parent (the launch process's parent, /proc); once that is
no longer the runner (it died: the launch process was re-parented), the rank sends itself
SIGTERM, which the training loop handles as any SIGTERM (train/training/tick.py StopRequested:
every rank agrees on a step, saves it, exits 0). Nothing runs in the training step; the thread
is started only under that launcher on Linux, and never under pdsh, torchrun, accelerate or
plain python. docs/checkpoints.md "Stopping a run" says what each launcher does with a signal.
"""

from __future__ import annotations

import os
import signal
import threading
import time

POLL_S = 0.5


def _stat(pid: int) -> tuple[str, int] | None:
    """(command line, parent pid) of `pid` from /proc; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return cmdline, int(stat[stat.rindex(")") + 2:].split()[1])  # after "(comm) state": the ppid
    except (OSError, ValueError, IndexError):
        return None


def runner_above(pid: int | None = None) -> tuple[int, int] | None:
    """(the launch process, the `deepspeed` runner above it) where this process was started by a
    single-node `deepspeed` launch on this machine; None otherwise (another launcher, pdsh, or a
    runner already gone)."""
    me = _stat(pid or os.getpid())
    parent = _stat(me[1]) if me else None
    if parent is None or "deepspeed.launcher.launch" not in parent[0]:
        return None
    runner = _stat(parent[1])
    if runner is None or not any(os.path.basename(a) == "deepspeed" or a == "deepspeed.launcher.runner"
                                 for a in runner[0].split()):
        return None  # e.g. the shell pdsh started on a node of a multi-node launch
    return me[1], parent[1]


def watch(launcher: str, rank: int) -> threading.Thread | None:
    """Under the single-node deepspeed launcher: start the thread that turns the runner's end into
    a SIGTERM of this process (module docstring). Returns it, or None where nothing is watched."""
    if launcher != "deepspeed" or not os.path.isdir("/proc"):
        return None
    found = runner_above()
    if found is None:
        return None
    launch, runner = found

    def loop():
        while True:
            time.sleep(POLL_S)
            now = _stat(launch)
            if now is None:
                return  # the launch process itself ended (on a signal it terminates the ranks itself)
            if now[1] != runner:  # re-parented: the runner has ended
                if rank == 0:
                    print(f"zerotrain: the deepspeed launcher (pid {runner}) has ended: stopping as on SIGTERM "
                          f"(this step, a checkpoint, exit)", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                return

    t = threading.Thread(target=loop, name="zerotrain-deepspeed-launcher-watch", daemon=True)
    t.start()
    return t
