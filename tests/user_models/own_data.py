"""A user's own datasets (data.kind py, tests/test_user_data.py), for the model of own_loss.py."""

import torch
from torch.utils.data import Dataset, IterableDataset


class Points(Dataset):
    """Noisy linear targets; sample i depends only on (seed, i)."""

    def __init__(self, n: int, features: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(n, features, generator=g)
        w = torch.arange(1, features + 1, dtype=torch.float32)
        self.target = self.features @ w[:, None] + 0.01 * torch.randn(n, 1, generator=g)

    def __len__(self):
        return len(self.features)

    def __getitem__(self, i):
        return {"features": self.features[i], "target": self.target[i]}


def rename(samples: list) -> dict:
    """The batch own_loss.Regressor's forward(x, y) takes: without this collate_fn it gets
    features= and target= and fails."""
    return {"x": torch.stack([s["features"] for s in samples]), "y": torch.stack([s["target"] for s in samples])}


def build(n: int = 256, features: int = 4, seed: int = 0) -> dict:
    return {"train": Points(n, features, seed), "val": Points(64, features, seed + 1), "collate_fn": rename}


def plain(n: int = 64) -> Dataset:
    """A bare Dataset whose samples already have the model's keys."""
    ds = Points(n, 4, 0)

    class Renamed(Dataset):
        def __len__(self):
            return len(ds)

        def __getitem__(self, i):
            s = ds[i]
            return {"x": s["features"], "y": s["target"]}
    return Renamed()


def raises(**kwargs):
    raise FileNotFoundError("/data/my_images: no such directory")


def a_number():
    return 42


class Stream(IterableDataset):
    def __iter__(self):
        yield {"x": torch.zeros(4)}


def iterable():
    return Stream()


def strings():
    return ["a", "b"]
