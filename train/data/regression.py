"""Synthetic linear-regression data (the DDP tutorials' toy problem): y = x.w + b + noise.

The true w and b are a function of the seed only and are returned, so tests can check
that training recovers them.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def true_params(num_features: int, seed: int) -> tuple[torch.Tensor, float]:
    g = torch.Generator().manual_seed(seed + 7)
    return torch.randn(num_features, generator=g), float(torch.randn(1, generator=g))


class Regression(Dataset):
    def __init__(self, num_samples: int, num_features: int, noise: float, seed: int, split: str):
        w, b = true_params(num_features, seed)
        g = torch.Generator().manual_seed(seed + (11 if split == "train" else 13))
        self.x = torch.randn(num_samples, num_features, generator=g)
        self.y = self.x @ w + b + noise * torch.randn(num_samples, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i:i + 1]}
