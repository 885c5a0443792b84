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
