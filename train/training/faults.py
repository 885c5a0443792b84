"""Deterministic fault injection for the reliability tests (environment-driven, off by default).

ZEROTRAIN_INJECT_NAN="3,4"   rank 0's loss becomes NaN at those optimizer steps (1-based).
ZEROTRAIN_INJECT_KILL="1:70" rank 1 SIGKILLs itself once optimizer step 70 is done (logged,
                             evaluated, saved): a crashed rank at a known step, no racing
                             a test's kill against a fast loop.
"""

from __future__ import annotations

import os
import signal


def _steps(var: str) -> set[int]:
    raw = os.environ.get(var, "")
    return {int(s) for s in raw.split(",") if s.strip()}


def nan_loss_at(step: int, rank: int) -> bool:
    return rank == 0 and step in _steps("ZEROTRAIN_INJECT_NAN")


def kill_after(step: int, rank: int) -> None:
    raw = os.environ.get("ZEROTRAIN_INJECT_KILL", "")
    if raw and tuple(int(x) for x in raw.split(":")) == (rank, step):
        os.kill(os.getpid(), signal.SIGKILL)
