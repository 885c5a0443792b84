"""Consolidated weights from the live state of a run (checkpoint.export, `Checkpointer.export`):
every rank gathers one tensor at a time (DeepSpeed's own full-parameter accessors under ZeRO)
and rank 0 writes them, one shard at a time, in the Hugging Face layout
(train/checkpoint/weights.py), or a LoRA run's adapter in PEFT's layout
(train/checkpoint/adapter.py). `zerotrain export` writes the same from a saved checkpoint."""

from __future__ import annotations

from pathlib import Path

import torch

from zerotrain.train.checkpoint import adapter
from zerotrain.train.checkpoint.files import persistent_buffers
from zerotrain.train.checkpoint.weights import EXPORT_DTYPES, write_weights


def export_adapter(out: Path, holder, lora: dict, dtype: str, is_main: bool) -> int:
    """The LoRA adapter, gathered tensor by tensor (under ZeRO-3 a partitioned adapter is a shard
    here; full_param is DeepSpeed's collective gather), written by rank 0. Returns how many
    tensors it holds."""
    trained, tensors = [s for s in holder.slots if s.trainable], {}
    for s in trained:
        t = holder.full_param(s)  # a collective under ZeRO: every rank, in slot order
        if is_main:
            tensors[s.name] = t
    adapter.write_adapter(out, lora, tensors, EXPORT_DTYPES[dtype], is_main)
    return len(trained)


def export_weights(out: Path, holder, raw_model: torch.nn.Module, workload, cfg, is_main: bool):
    """Every parameter and persistent buffer in `cfg.export_dtype`, in shards of at most
    `cfg.max_shard_size`, with the workload's tied names, family and model config."""
    slots = {s.name: s for s in holder.slots}
    buffers = dict(persistent_buffers(raw_model))
    entries = [(s.name, s.shape, torch.float32) for s in holder.slots] + \
              [(n, tuple(b.shape), b.dtype) for n, b in buffers.items()]

    def get(name):
        if name in slots:
            return holder.full_param(slots[name])
        return buffers[name].detach().cpu()

    write_weights(out, entries, get, dtype=EXPORT_DTYPES[cfg.export_dtype],
                  max_shard_size=cfg.max_shard_size, tied=workload.tied, family=workload.family,
                  model_config=workload.model_config, is_writer=is_main)
