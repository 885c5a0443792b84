"""User-facing errors: one readable message, exit code 2, no traceback unless --debug."""

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


class TrainingDiverged(UserError):
    """NaN/Inf beyond the configured tolerance; the last good state was checkpointed."""

    exit_code = 3


def did_you_mean(name: str, choices) -> str:
    """' (did you mean "x"?)' for the closest valid name, or ''."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return f' (did you mean "{close[0]}"?)' if close else ""
