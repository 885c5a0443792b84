"""Whether this process is in a torch.distributed process group: the one guard every caller uses
(a single-process run, a test in-process, or a rank before Accelerate made its group, has none)."""

from __future__ import annotations

import torch.distributed as dist


def exists() -> bool:
    """A default process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def size() -> int:
    """The default group's world size; 1 without one."""
    return dist.get_world_size() if exists() else 1


# Where the loop stands, for the messages of a collective that failed (train/launch/collectives.py):
# set by the loop at each step, stop vote, evaluation and save; a list write, nothing else.
_WHERE = ["start-up", None]


def at(phase: str, step: int | None) -> None:
    """The loop enters `phase` ("training step", "stop vote", "evaluation", "save", ...) of `step`."""
    _WHERE[0], _WHERE[1] = phase, step


def where() -> str:
    """e.g. "step 4 (evaluation)", or "start-up"."""
    phase, step = _WHERE
    return phase if step is None else f"step {step} ({phase})"
