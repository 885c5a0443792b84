"""The user-error vocabulary: one readable message, exit code 2, no traceback unless --debug.

Defined here, at the bottom of the dependency graph, because models/ depends on nothing in
train/ and its builders raise these too. train/errors.py re-exports every name (and adds
TrainingDiverged and the `user_errors` handler that prints them), so both import paths give
the same classes.
"""

from __future__ import annotations

import difflib
import re

# torch re-raises a DataLoader worker's exception in the main process as
# type(e)("Caught X in DataLoader worker process N.\nOriginal Traceback ...\n...X: <message>").
_WORKER_WRAPPED = re.compile(r"Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback")


class UserError(Exception):
    """Something the user can fix (config, data, launch). Printed without a traceback: also when
    it was raised in a DataLoader worker, whose wrapper would put the worker's traceback into the
    message (the message is then the worker's own, the same line as in-process)."""

    exit_code = 2

    def __init__(self, *args):
        if len(args) == 1 and isinstance(args[0], str) and _WORKER_WRAPPED.match(args[0]):
            args = (args[0].rsplit(f"{type(self).__name__}: ", 1)[-1].strip(),)
        super().__init__(*args)


class ConfigError(UserError):
    """A run file, DeepSpeed JSON, hostfile or CLI flag is wrong."""


class DataError(UserError):
    """A dataset is missing, empty or malformed."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupted or from another model."""


def did_you_mean(name: str, choices) -> str:
    """' (did you mean "x"?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f' (did you mean "{close[0]}"?)' if close else ""
