"""The learning-rate schedule: linear warmup, then cosine, linear or constant (optim.schedule)."""

from __future__ import annotations

import math

from zerotrain.train.config import OptimConfig


def lr_at(cfg: OptimConfig, step: int, max_steps: int) -> float:
    """LR for optimizer step `step` (0-based). A pure function of the global step, so it is
    the same for any number of processes or accumulation steps and needs no state on resume."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return cfg.lr
    decay = max(1, max_steps - cfg.warmup_steps)
    frac = min(1.0, (step - cfg.warmup_steps) / decay)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * frac
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * frac))
