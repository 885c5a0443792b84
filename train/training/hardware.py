"""Run options that only concern the hardware: TF32, channels-last, torch.compile, loader workers (CPU threads:
train/launch/device_env.py, before torch loads).

Each decision is a small pure function of the config, the strategy and the machine, so it is
tested on CPU; build.py applies them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerotrain.train.config import DataSection, RunConfig
from zerotrain.train.errors import ConfigError
from zerotrain.train.launch import device_env


def float32_matmul_precision(cfg: RunConfig, cuda: bool) -> str | None:
    """torch's float32 matmul precision for this run: "high" (TF32 tensor cores) or "highest"
    on CUDA, None (leave torch's default) without a GPU."""
    if not cuda:
        return None
    return "high" if cfg.hardware.tf32 else "highest"


def apply_tf32(cfg: RunConfig, cuda: bool) -> str | None:
    precision = float32_matmul_precision(cfg, cuda)
    if precision is not None:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cfg.hardware.tf32  # convolutions (cuDNN's own switch)
    return precision


def use_channels_last(cfg: RunConfig, strategy, family: str, cuda: bool) -> bool:
    """model.channels_last (a key of vision models only): None = vision models on a GPU where
    the strategy keeps the layout."""
    want = cfg.model.channels_last if family == "vision" else None
    return strategy.check_channels_last(cfg, want, family, cuda)


def check_attention(spec, cuda: bool) -> None:
    """flex_attention (model.attn_implementation, or an hf: model's config.json) trains only on a
    GPU: torch's FlexAttention has no backward on the CPU, so a CPU run would stop in its first
    backward with torch's NotImplementedError. Refused here, before the data and the model."""
    impl = (spec.hf_config or {}).get("attn_implementation") if spec.family == "hf" else None
    if impl == "flex_attention" and not cuda:
        raise ConfigError(f"model.attn_implementation flex_attention ({spec.name}) cannot train on the CPU: torch's "
                          f"FlexAttention has no backward there; use --model.attn_implementation sdpa (the same "
                          f"attention) on a CPU, flex_attention on a GPU")


def cores_per_rank(local_world: int) -> int:
    return max(1, device_env.cores() // max(1, local_world))


SHARD_WORKERS = 1  # auto workers per rank for a sharded corpus (TokensData.num_workers says why)


def is_sharded_corpus(data: DataSection) -> bool:
    """data.path, or any data.sources entry, is a shard directory (a disk-sized corpus)."""
    from zerotrain.train.data.shards import is_sharded
    if data.kind != "tokens":
        return False
    paths = [s.path for s in data.sources] if data.sources else [data.path]
    return any(p is not None and is_sharded(Path(p).expanduser()) for p in paths)


def data_workers(data: DataSection, local_world: int) -> int:
    """data.num_workers; None = decode images in worker processes (leaving a core for the
    training loop), SHARD_WORKERS to read a sharded corpus from disk, nothing for data that
    is already in memory or in one small memory-mapped file. data.kind stream: 0, its
    tokenizer pool is its own (data.num_workers sizes that, train/data/stream.py)."""
    if data.kind == "stream":
        return 0
    if data.num_workers is not None:
        return data.num_workers
    if data.kind == "imagefolder":
        return min(8, cores_per_rank(local_world) - 1)
    return SHARD_WORKERS if is_sharded_corpus(data) else 0


def loader_options(workers: int, accum: int, cuda: bool, train: bool) -> dict:
    """DataLoader keyword arguments around the worker count. Pinned host batches only on CUDA
    (the copy to the GPU then runs asynchronously; on a CPU pinning is pure overhead). With
    workers: each keeps max(2, accum / workers) micro-batches in flight, so a whole optimizer
    step's micro-batches are ready before it starts; the training loader's workers persist
    across epochs (no re-fork of a large rank process per epoch, and they resume where the
    sampler says), the validation loader's exit after each evaluation (idle between evals)."""
    opts = {"num_workers": workers, "pin_memory": cuda}
    if workers > 0:
        opts.update(prefetch_factor=max(2, -(-accum // workers)), persistent_workers=train)
    return opts
