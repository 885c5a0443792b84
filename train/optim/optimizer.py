"""Optimizer construction and setting its per-step learning rate (the schedule: schedule.py).

The optimizer is always built here (never from the DeepSpeed JSON) so that DDP and every
ZeRO stage run the same AdamW: torch's, or DeepSpeedCPUAdam when ZeRO offloads the
optimizer to the CPU (DeepSpeed refuses a torch optimizer there).
"""

from __future__ import annotations

import torch

from train.config import OptimConfig
from train.dsconfig import DSSetup


def _shape(p) -> tuple:
    # Under ZeRO-3 construction parameters are already partitioned (shape [0]).
    return tuple(getattr(p, "ds_shape", p.shape))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: not norms, biases or embeddings (the usual GPT/Llama recipe)."""
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:  # tied weights: the first owner decides
                continue
            seen.add(id(p))
            (no_decay if len(_shape(p)) < 2 or isinstance(module, torch.nn.Embedding) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, ds: DSSetup):
    groups = param_groups(model, cfg.weight_decay)
    if not groups:
        from train.errors import ConfigError
        raise ConfigError("the model has no trainable parameters (model.freeze_backbone with no head?)")
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if ds.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # JIT-builds once (~45 s on 2 cores)
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
    # DDP: the fused kernel (CUDA and CPU), which also skips a non-finite step on the device
    # (found_inf, set by the trainer or the GradScaler) without a host sync. DeepSpeed steps its
    # own flat partitions with the torch default.
    return torch.optim.AdamW(groups, fused=True if not ds.is_deepspeed else None, **kw)


def set_lr(optimizer, lr: float):
    for g in optimizer.param_groups:
        g["lr"] = lr
