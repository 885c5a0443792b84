"""User-facing errors: one readable message, exit code 2, no traceback unless --debug.

The error classes are models/errors.py's, re-exported; TrainingDiverged (a training outcome)
and `user_errors` (how the entry points report them) are training's own."""

from __future__ import annotations

import contextlib
import os
import sys

# The vocabulary lives in models/ (which imports nothing from train/); every existing
# `from train.errors import ConfigError` keeps working with the very same classes.
from models.errors import CheckpointError, ConfigError, DataError, UserError, did_you_mean  # noqa: F401


class TrainingDiverged(UserError):
    """NaN/Inf beyond the configured tolerance; the last good state was checkpointed."""

    exit_code = 3


@contextlib.contextmanager
def user_errors(debug: bool = False):
    """A UserError becomes one line on stderr and exit code 2 (traceback only with --debug)."""
    try:
        yield
    except UserError as e:
        if debug:
            raise
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"{prefix}zerotrain: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except Exception as e:
        # A collective failing because another node died: say which node (exit 1, not a usage error).
        lost = sys.modules["train.launch.distributed"].explain_peer_failure(e) if "train.launch.distributed" in sys.modules else None
        if lost is None or debug:
            raise
        print(f"[rank {os.environ.get('RANK', '?')}] zerotrain: error: {lost}", file=sys.stderr, flush=True)
        sys.exit(1)
