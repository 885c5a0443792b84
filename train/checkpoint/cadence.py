"""When the loop saves: checkpoint.every_steps and checkpoint.every_minutes, the same step on every rank.

A save is collective (every rank writes its part, then rank 0 completes it), so all ranks must
decide to save at the same step. A step count is the same everywhere; wall time is not (each
rank has its own clock and reaches a step at its own moment). So only rank 0's clock counts:
each step rank 0 offers a *ticket* (the number the next save will have, once every_minutes
have passed since the last save ended; 0 before), the other ranks offer 0, and the sum travels
in the trainer's stop vote (train/training/tick.py StopVote: an async all-reduce of a CPU
tensor over gloo, read one step later). Every rank reads the same sum at the same step and saves
when it equals its own count of saves + 1. A vote cast before a save and read after it carries
the old number and is ignored, so one expiry never makes two saves.

Cost: rank 0 reads a monotonic clock once per step; the vote carries one more float. No extra
collective and no device read (BENCHMARKS.md "Checkpoint cadence").
"""

from __future__ import annotations

import time
from typing import Callable, Optional


class SaveCadence:
    """Decides which steps save. Per step: `ticket()` goes into the vote, `due(step, voted, done)`
    with the ticket the vote agreed on (`Agreed.ticket`), `saved()` after a save completed.
    `clock` (seconds, monotonic) is injectable for tests."""

    def __init__(self, every_steps: int, every_minutes: float, is_main: bool,
                 clock: Callable[[], float] = time.monotonic):
        self.every_steps = every_steps
        self.interval_s = every_minutes * 60.0
        self.is_main = is_main
        self.clock = clock
        self.saves = 0                 # saves made by the loop in this run: the same count on every rank
        self.last = clock()            # when the last save ended (the start: the loop's first step)

    def ticket(self) -> float:
        """This rank's part of the step's vote: on rank 0, the next save's number once
        every_minutes have passed since the last save (or the start); 0 otherwise."""
        if not (self.interval_s and self.is_main):
            return 0.0
        return float(self.saves + 1) if self.clock() - self.last >= self.interval_s else 0.0

    def due(self, step: int, voted: float, done: bool) -> Optional[str]:
        """"steps" or "minutes" when the step just completed saves, else None. `voted` is the
        vote's sum of tickets (rank 0's ticket), the same on every rank; the last step (done)
        saves through checkpoint.save_at_end instead."""
        if done:
            return None
        if self.every_steps and step % self.every_steps == 0:
            return "steps"
        if self.interval_s and voted == self.saves + 1:
            return "minutes"
        return None

    def saved(self):
        """A save completed: count it and restart the clock."""
        self.saves += 1
        self.last = self.clock()
