"""Deterministic fault injection for the reliability tests (environment-driven, off by default).

ZEROTRAIN_INJECT_NAN="3,4"   rank 0's loss becomes NaN at those optimizer steps (1-based).
ZEROTRAIN_INJECT_KILL="1:70" rank 1 SIGKILLs itself once optimizer step 70 is done (logged,
                             evaluated, saved): a crashed rank at a known step, no racing
                             a test's kill against a fast loop.
Under torchrun's elastic agent (set in one node's environment only):
ZEROTRAIN_INJECT_KILL_NODE=8 the node dies once step 8 is done: each of its ranks SIGKILLs its
                             launcher (the agent, so nothing restarts there) and its own process
                             group (torchrun starts every rank in a session of its own).
ZEROTRAIN_INJECT_HOLD=9      once step 9 is done, wait (at most 600 s) for SIGTERM/SIGINT before
                             the next step: a membership change (the agent's SIGTERM) lands at a
                             known step however fast the loop is.
"""

from __future__ import annotations

import os
import signal
import time


def _steps(var: str) -> set[int]:
    raw = os.environ.get(var, "")
    return {int(s) for s in raw.split(",") if s.strip()}


def nan_loss_at(step: int, rank: int) -> bool:
    return rank == 0 and step in _steps("ZEROTRAIN_INJECT_NAN")


def kill_after(step: int, rank: int) -> None:
    raw = os.environ.get("ZEROTRAIN_INJECT_KILL", "")
    if raw and tuple(int(x) for x in raw.split(":")) == (rank, step):
        os.kill(os.getpid(), signal.SIGKILL)


def kill_node_after(step: int) -> None:
    raw = os.environ.get("ZEROTRAIN_INJECT_KILL_NODE", "")
    if raw and int(raw) == step:
        os.kill(os.getppid(), signal.SIGKILL)
        os.killpg(os.getpgid(0), signal.SIGKILL)


def hold_for_signal(step: int, stop) -> None:
    raw = os.environ.get("ZEROTRAIN_INJECT_HOLD", "")
    if raw and int(raw) == step:
        deadline = time.monotonic() + 600
        while not stop.flag and time.monotonic() < deadline:
            time.sleep(0.05)
