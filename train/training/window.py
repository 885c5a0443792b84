"""One optimizer step's result and one logging interval's statistics (the trainer's log line)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch


class StepResult(NamedTuple):
    """One optimizer step, as train_step returns it."""
    loss_sum: torch.Tensor         # the micro-batch losses summed, on the device (float64)
    lr: float
    data_s: float                  # waiting for batches
    real_tokens: Optional[int]     # non-pad tokens of the global batch, where the data counts them
    positions: int = 0             # token positions this rank's forwards ran on (padding included)


@dataclass(eq=False)
class Window:
    """One logging interval's statistics, summed step by step and reset at each log line. The
    loss stays on the device until the log line reads it; train_s counts step time only (not
    evaluation or checkpoint pauses)."""

    device: torch.device
    loss: torch.Tensor = field(init=False)   # summed micro-batch losses (float64)
    micro: int = 0                           # micro-batches summed into `loss`
    data_s: float = 0.0
    train_s: float = 0.0
    steps: int = 0
    real: Optional[int] = None               # non-pad tokens, where the data counts them
    positions: int = 0                       # this rank's token positions as built (padding included)

    def __post_init__(self):
        self.reset()

    def add(self, step: StepResult, micro: int, seconds: float):
        self.loss += step.loss_sum
        self.micro += micro
        self.data_s += step.data_s
        self.train_s += seconds
        self.steps += 1
        self.positions += step.positions
        if step.real_tokens is not None:
            self.real = (self.real or 0) + step.real_tokens

    def reset(self):
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.micro, self.data_s, self.train_s, self.steps, self.real, self.positions = 0, 0.0, 0.0, 0, None, 0
