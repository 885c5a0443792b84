"""Deterministic fault injection for the reliability tests (environment-driven, off by default).

ZEROTRAIN_INJECT_NAN="3,4"   rank 0's loss becomes NaN at those optimizer steps (1-based).
"""

from __future__ import annotations

import os


def _steps(var: str) -> set[int]:
    raw = os.environ.get(var, "")
    return {int(s) for s in raw.split(",") if s.strip()}


def nan_loss_at(step: int, rank: int) -> bool:
    return rank == 0 and step in _steps("ZEROTRAIN_INJECT_NAN")
