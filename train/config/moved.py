"""Keys that moved between sections of the run config, and the reading of saved records of the
layout before.

A run file (or a `--section.key` override) that still uses an old key is refused in one line
naming the new key (train/config/loader.py): a run file is the user's to edit. A config a run
*saved* (config.json, a checkpoint's meta.json "config") is translated instead (upgrade_saved):
checkpoints written by the previous release must resume and export as before.
"""

from __future__ import annotations

import copy

# old dotted key -> new dotted key, and the release that moved it
MOVED: dict[str, str] = {
    "train.compile": "hardware.compile",
    "train.tf32": "hardware.tf32",
    "train.host_malloc": "hardware.host_malloc",
    "train.trace_data": "debug.trace_data",
    "train.progress": "logging.progress",
}
MOVED_IN = "0.2"


def moved_message(old: str, where: str) -> str:
    """The one line for an old key: `old` as the user wrote it (a dotted key or a --flag);
    `where`: "in run.yaml", "on the command line"."""
    dash = "--" if old.startswith("--") else ""
    new = MOVED[old.removeprefix("--")]
    return f"{old} moved to {dash}{new} in zerotrain {MOVED_IN}; rename it {where}"


def find_moved(raw: dict) -> str | None:
    """The first old key a run file's mapping holds, or None."""
    for old in MOVED:
        section, key = old.split(".")
        if isinstance(raw.get(section), dict) and key in raw[section]:
            return old
    return None


def upgrade_saved(record: dict | None) -> dict | None:
    """A saved run config (config.json, a checkpoint's "config") in the current layout: the old
    keys moved to their new sections (a new key already there wins). Records of this layout come
    back equal; None stays None."""
    if not isinstance(record, dict):
        return record
    out = copy.deepcopy(record)
    for old, new in MOVED.items():
        (section, key), (to_section, to_key) = old.split("."), new.split(".")
        src = out.get(section)
        if isinstance(src, dict) and key in src:
            value = src.pop(key)
            dst = out.setdefault(to_section, {})
            if isinstance(dst, dict):
                dst.setdefault(to_key, value)
    return out
