"""Optimizer construction and setting its per-step learning rate (the schedule: schedule.py).

The optimizer is always built here (never from the DeepSpeed JSON) so that DDP and every
ZeRO stage run the same AdamW: torch's, or DeepSpeedCPUAdam when ZeRO offloads the
optimizer to the CPU (DeepSpeed refuses a torch optimizer there).
"""

from __future__ import annotations

import torch

from zerotrain.train.config import OptimConfig


def _shape(p) -> tuple:
    # Under ZeRO-3 construction parameters are already partitioned (shape [0]).
    return tuple(getattr(p, "ds_shape", p.shape))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: not norms, biases or embeddings (the usual GPT/Llama recipe). Each
    group also keeps its parameters' names ("names"; the optimizer carries the key along, also
    where ZeRO swaps "params" for flat partitions): `zerotrain verify` compares which parameters
    decay (Strategy.param_groups)."""
    named = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # tied weights: the first owner decides
                continue
            seen.add(id(p))
            (no_decay if len(_shape(p)) < 2 or isinstance(module, torch.nn.Embedding) else decay).append(p)
    groups = [{"params": ps, "weight_decay": wd, "names": [named.get(id(p), "?") for p in ps]}
              for ps, wd in ((decay, weight_decay), (no_decay, 0.0))]
    return [g for g in groups if g["params"]]


def groups_and_args(model: torch.nn.Module, cfg: OptimConfig):
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        from zerotrain.train.errors import ConfigError
        raise ConfigError("the model has no trainable parameters (model.freeze_backbone with no head?)")
    return groups, dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def adamw(model: torch.nn.Module, cfg: OptimConfig, fused: bool | None):
    """torch AdamW over the decay / no-decay groups; `fused` as torch takes it (None: its default)."""
    groups, kw = groups_and_args(model, cfg)
    return torch.optim.AdamW(groups, fused=fused, **kw)


def set_lr(optimizer, lr: float):
    for g in optimizer.param_groups:
        g["lr"] = lr
