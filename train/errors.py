"""User-facing errors: one readable message, exit code 2, no traceback unless --debug."""

from __future__ import annotations

import contextlib
import difflib
import os
import sys


class UserError(Exception):
    """Something the user can fix (config, data, launch). Printed without a traceback."""

    exit_code = 2


class ConfigError(UserError):
    """A run file, DeepSpeed JSON, hostfile or CLI flag is wrong."""


class DataError(UserError):
    """A dataset is missing, empty or malformed."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupted or from another model."""


class TrainingDiverged(UserError):
    """NaN/Inf beyond the configured tolerance; the last good state was checkpointed."""

    exit_code = 3


def did_you_mean(name: str, choices) -> str:
    """' (did you mean "x"?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f' (did you mean "{close[0]}"?)' if close else ""


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
