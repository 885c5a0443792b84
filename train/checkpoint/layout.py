"""What a checkpoint stores of a model besides its parameters' values: the AdamW moments kept
per parameter, and the buffers that belong to the model's state. The per-backend readers and
writers of these are the strategy's holders (train/strategy/holders.py)."""

from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def persistent_buffers(model) -> list[tuple[str, torch.Tensor]]:
    """Buffers that belong to the model's state (BatchNorm statistics), not derived ones (RoPE tables)."""
    out, seen = [], set()
    for mod_name, mod in model.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is None or name in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            out.append((f"{mod_name}.{name}" if mod_name else name, buf))
    return out
