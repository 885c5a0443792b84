"""The user-error vocabulary: one readable message, exit code 2, no traceback unless --debug.

Defined here, at the bottom of the dependency graph, because models/ depends on nothing in
train/ and its builders raise these too. train/errors.py re-exports every name (and adds
TrainingDiverged and the `user_errors` handler that prints them), so both import paths give
the same classes.
"""

from __future__ import annotations

import difflib


class UserError(Exception):
    """Something the user can fix (config, data, launch). Printed without a traceback."""

    exit_code = 2


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
