"""User-facing errors: one readable message, exit code 2, no traceback unless --debug.

The error classes are models/errors.py's, re-exported; TrainingDiverged (a training outcome)
and `user_errors` (how the entry points report them) are training's own."""

from __future__ import annotations

import contextlib
import os
import sys

# The vocabulary lives in models/ (which imports nothing from train/); every existing
# `from zerotrain.train.errors import ConfigError` keeps working with the very same classes.
from zerotrain.models.errors import CheckpointError, ConfigError, DataError, UserError, did_you_mean  # noqa: F401


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
        say(f"{prefix}zerotrain: error: {e}")
        if _distributed() is not None:
            _distributed().report_user_error(str(e))
        sys.exit(e.exit_code)
    except Exception as e:
        # debug.collectives: ranks at different collectives, or one that never came (exit 1).
        if not debug and collective_failure(e):
            sys.exit(1)
        # A collective failing because another rank died: say which node (exit 1, not a usage error),
        # or, where that rank stopped on a user error it already printed, exit as it did.
        lost = _distributed().explain_peer_failure(e) if _distributed() is not None else None
        if lost is None or debug:
            raise
        if _distributed().peer_user_error() is not None:
            sys.exit(2)
        say(f"[rank {os.environ.get('RANK', '?')}] zerotrain: error: {lost}")
        sys.exit(1)


def say(line: str) -> None:
    """Print one line to stderr in one write. The ranks of a launch share the launcher's stderr,
    and print() writes a line and its newline in two writes (unbuffered, as under
    PYTHONUNBUFFERED): another rank's line then lands between them, glued to the end of this
    one instead of starting its own (seen in tests/test_collectives.py's extra all-reduce, where
    it read as a rank exiting without its line). One write of a line
    shorter than the pipe's atomic size (4096 bytes on Linux) is never split."""
    stream = sys.stderr
    stream.flush()  # whatever this process wrote before goes first, on its own
    stream.write(line + "\n")
    stream.flush()


def collective_failure(exc: BaseException) -> bool:
    """debug.collectives: print this rank's one line for a collective check that failed, once
    (train/main.py calls it before the trainer closes, user_errors after); True if `exc` is one."""
    if getattr(exc, "zerotrain_reported", False):
        return True
    if _distributed() is None or not _distributed().report_collective_failure(exc):
        return False
    exc.zerotrain_reported = True
    return True


_PEERS = None


def report_peers_with(peers) -> None:
    """Called by train/launch/peers.py when a launch imports it (a bad flag never imports torch
    for this): `peers` has report_user_error, peer_user_error, explain_peer_failure and
    report_collective_failure, which user_errors uses to tell the other ranks, to name a rank
    that died, and to say which ranks ran different collectives (debug.collectives)."""
    global _PEERS
    _PEERS = peers


def _distributed():
    """The peers registered by report_peers_with, or None in a process that launched nothing."""
    return _PEERS
