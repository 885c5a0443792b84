"""Run options that only concern the hardware: TF32, channels-last, torch.compile, loader workers.

Each decision is a small pure function of the config, the strategy and the machine, so it is
tested on CPU; build.py applies them.
"""

from __future__ import annotations

import os

import torch

from train.config import DataConfig, RunConfig
from train.errors import ConfigError


def float32_matmul_precision(cfg: RunConfig, cuda: bool) -> str | None:
    """torch's float32 matmul precision for this run: "high" (TF32 tensor cores) or "highest"
    on CUDA, None (leave torch's default) without a GPU."""
    if not cuda:
        return None
    return "high" if cfg.train.tf32 else "highest"


def apply_tf32(cfg: RunConfig, cuda: bool) -> str | None:
    precision = float32_matmul_precision(cfg, cuda)
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32  # convolutions (cuDNN's own switch)
    return precision


def use_channels_last(cfg: RunConfig, ds, family: str, cuda: bool) -> bool:
    """model.channels_last: None = vision models under DDP on a GPU. DeepSpeed copies every
    parameter into its flat (contiguous, NCHW) buffers, which undoes the layout."""
    want = cfg.model.channels_last
    if want and family != "vision":
        raise ConfigError(f"model.channels_last is for torchvision models (convolutions); {cfg.model.name} is a "
                          f"{family} model: remove it")
    if want and ds.is_deepspeed:
        raise ConfigError(f"model.channels_last: DeepSpeed ({ds.describe()}) keeps parameters in flat contiguous "
                          f"buffers, which undoes the channels-last layout; use ds_configs/ddp.json or remove it")
    if want is None:
        return family == "vision" and cuda and not ds.is_deepspeed
    return bool(want)


def check_compile(cfg: RunConfig, ds) -> None:
    if cfg.train.compile and ds.is_deepspeed and ds.stage == 3:
        raise ConfigError(f"train.compile with ZeRO-3 ({ds.path}): DeepSpeed's parameter gathering hooks break "
                          f"compiled graphs; use ZeRO-0/1/2 or DDP, or set train.compile false")


def cores_per_rank(local_world: int) -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world))


def data_workers(data: DataConfig, local_world: int) -> int:
    """data.num_workers; None = decode images in worker processes (leaving a core for the
    training loop), nothing for data that is already in memory or memory-mapped."""
    if data.num_workers is not None:
        return data.num_workers
    if data.kind != "imagefolder":
        return 0
    return min(8, cores_per_rank(local_world) - 1)
