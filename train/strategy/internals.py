"""Every private DeepSpeed attribute zerotrain reads, in one place: when a DeepSpeed upgrade
moves one, this module (and tests/test_deepspeed_internals.py, which names the attribute and the
version) is where it shows."""

from __future__ import annotations

# DeepSpeedEngine's step counters a checkpoint keeps (engine.global_steps, ...).
COUNTERS = ("global_steps", "global_samples", "skipped_steps")
