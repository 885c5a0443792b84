"""The training backends: one Strategy object per backend owns everything that differs between
plain DDP and DeepSpeed ZeRO (base.py says what). `for_setup` picks it from the run's resolved
DeepSpeed JSON (ds_config.py)."""

from __future__ import annotations

from zerotrain.train.strategy.base import Strategy
from zerotrain.train.strategy.ddp import DDPStrategy
from zerotrain.train.strategy.ds_config import DSSetup
from zerotrain.train.strategy.zero import ZeroStrategy

__all__ = ["Strategy", "DDPStrategy", "ZeroStrategy", "for_setup"]


def for_setup(ds: DSSetup) -> Strategy:
    """The Strategy of a resolved DeepSpeed JSON: a "ddp" block is plain DDP, anything else ZeRO."""
    return DDPStrategy(ds) if ds.backend == "ddp" else ZeroStrategy(ds)
