"""The run's features: components of the loop (train/training/components.py says what a
component is) that the run config switches on, each in a module of its own that knows nothing of
the Trainer. A feature is built with the services, before the resume (train/training/assembly.py
start_services), from the narrow `Services` below; one with state (state_dict /
load_state_dict, and per-parameter tensors through `tensor_kinds`: train/checkpoint/state.py)
is registered with the checkpointer under its name, so its state comes back on resume.

Adding a feature: one module in train/training/ and one line in FEATURES (its `build`, which returns None
when the run does not use it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerotrain.train.training import early_stop, ema

if TYPE_CHECKING:
    from zerotrain.train.config import RunConfig
    from zerotrain.train.strategy.holders import Holder
    from zerotrain.train.training.evaluate import Evaluator


@dataclass(frozen=True)
class Services:
    """What a feature may be built with."""

    cfg: RunConfig
    holder: Holder            # each trained parameter's fp32 master value on this rank (train/strategy/holders.py)
    evaluator: Evaluator      # runs the validation split (every rank): val/* metrics
    is_main: bool


# In the order they see each step, after the evaluation and before the checkpoint.
FEATURES = (
    ema.build,         # train.ema
    early_stop.build,  # train.early_stop
)


def build_features(services: Services) -> list:
    """The run's features, in FEATURES' order."""
    return [f for f in (build(services) for build in FEATURES) if f is not None]
