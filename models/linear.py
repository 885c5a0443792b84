"""The minimal model of the PyTorch DDP tutorials: one Linear layer trained with MSE."""

import torch.nn as nn


class LinearRegression(nn.Module):
    def __init__(self, num_features: int = 10, out_features: int = 1):
        super().__init__()
        self.linear = nn.Linear(num_features, out_features)

    def forward(self, x):  # x (B, F) -> (B, out)
        return self.linear(x)
