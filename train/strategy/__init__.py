"""The training backends: one Strategy object per backend owns everything that differs between
plain DDP, DeepSpeed ZeRO and FSDP2 (base.py says what). Each backend module registers itself
(registry.py); `for_setup` makes the Strategy of the backend a run's resolved strategy JSON
names (ds_config.py). Importing the package imports every backend module, so the registry is
complete whenever any module of it is loaded."""

from __future__ import annotations

import zerotrain.train.strategy.registry as registry
from zerotrain.train.strategy.base import Strategy
from zerotrain.train.strategy.ddp import DDPStrategy
from zerotrain.train.strategy.ds_config import DSSetup
from zerotrain.train.strategy.zero import ZeroStrategy
from zerotrain.train.strategy.fsdp2 import FSDP2Strategy  # noqa: E402,I001 (registered after ZeRO)

__all__ = ["Strategy", "DDPStrategy", "ZeroStrategy", "FSDP2Strategy", "for_setup"]


def for_setup(ds: DSSetup) -> Strategy:
    """The Strategy of a resolved strategy JSON: its backend's (DSSetup.backend, the registry's name)."""
    return registry.get(ds.backend).strategy(ds)
