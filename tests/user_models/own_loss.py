"""A module that computes its own loss (model.loss "model"): forward(**batch) returns it."""

import torch.nn as nn
import torch.nn.functional as F


class Regressor(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.lin = nn.Linear(features, 1)

    def forward(self, x, y):
        return F.mse_loss(self.lin(x), y) * 2  # not what zerotrain would compute: the module's own


def regressor(features: int = 4) -> nn.Module:
    return Regressor(features)


class Rescaled(Regressor):
    """Reads a value of its own parameters at construction (as some user code does): cannot be
    built on the meta device."""

    def __init__(self, features: int):
        super().__init__(features)
        self.scale = float(self.lin.weight.abs().max().item())


def rescaled(features: int = 4) -> nn.Module:
    return Rescaled(features)
