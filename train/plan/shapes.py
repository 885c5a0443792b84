"""What the planner sizes: the model's trainable and frozen tensors (ModelShape), from a GPT
config, a bare parameter count or a built model, and the micro-batch (BatchShape)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_params: int
    # numel of every trainable tensor, per optimizer group, in the order DeepSpeed flattens them
    groups: tuple
    gpt: object = None          # models.gpt.GPTConfig for activations; None = parameter count only
    width: Optional[int] = None  # hidden size: fills the JSON's "auto" ZeRO sizes (train/strategy/ds_config.AUTO_SIZES)
    frozen: tuple = ()          # numel of parameters without gradients (held, never stepped)
    leaf_block: int = 0         # numel of the largest sparse-MoE block: gathered whole under ZeRO-3 (models/moe.py)
    active_params: Optional[int] = None  # mixture of experts: parameters one token uses (FLOPs); None = all

    @property
    def tensors(self) -> list[int]:
        return [n for g in self.groups for n in g]

    @property
    def shapes_known(self) -> bool:
        return len(self.tensors) > 1


@dataclass(frozen=True)
class BatchShape:
    """One rank's micro-batch as the planner sees it (what train.config.Batch counts, plus what
    changes the activations)."""

    micro: int
    seq_len: Optional[int]
    accum: int = 1
    checkpointing: bool = False
    sequence_parallel: int = 1  # distributed.sequence_parallel: each rank holds seq_len / N of a row
    document_mask: bool = False  # data.packing / data.document_mask: the GPT's (B, 1, T, T) mask, once
    reference_copy: bool = False  # train.objective dpo, full fine-tuning: a frozen fp32 copy of the model per rank
    ema_copy: bool = False        # train.ema: one more fp32 copy of the master elements a rank holds


def gpt_shape(name: str, cfg) -> ModelShape:
    """Tensor sizes of models/gpt.py's GPT, grouped exactly like train/optim.param_groups
    (decayed matrices first, then norms and the embedding; a tied lm_head counts once)."""
    d, kv, f = cfg.d_model, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim
    decay, no_decay = [], [cfg.vocab_size * d]               # tok_emb (an Embedding: not decayed)
    for _ in range(cfg.n_layer):
        no_decay.append(d)                                    # attn_norm
        decay += [d * (d + 2 * kv), d * d]                    # qkv, proj
        no_decay.append(d)                                    # mlp_norm
        decay += [d * 2 * f, f * d]                           # gate_up, down
    no_decay.append(d)                                        # final norm
    if not cfg.tie_embeddings:
        decay.append(d * cfg.vocab_size)                      # lm_head
    return ModelShape(name, sum(decay) + sum(no_decay), (tuple(decay), tuple(no_decay)), cfg, width=d)


def count_shape(n: int) -> ModelShape:
    return ModelShape(f"{n / 1e6:.1f}M params", n, ((n,),), None)


def module_shape(model, name: str, gpt=None, width: Optional[int] = None) -> ModelShape:
    """From a built (possibly ZeRO-3-partitioned) model, grouped like the trainer's optimizer."""
    from zerotrain.train.optim.optimizer import param_groups
    groups = tuple(tuple(int(getattr(p, "ds_numel", p.numel())) for p in g["params"])
                   for g in param_groups(model, 0.1))
    frozen = tuple(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if not p.requires_grad)
    total = sum(map(sum, groups)) + sum(frozen)
    moe = _moe_sizes(model)
    return ModelShape(name, total, groups, gpt, width=width or (gpt.d_model if gpt is not None else None),
                      frozen=frozen, leaf_block=moe.largest_block_params if moe else 0,
                      active_params=total - moe.active_params_delta if moe else None)


def _moe_sizes(model):
    """models/moe.py's view of a sparse mixture-of-experts model (None for a dense one)."""
    from zerotrain.models.moe import detect
    return detect(model, getattr(model, "config", None))
