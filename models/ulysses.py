"""Ulysses sequence parallelism, the model side: the two all-to-alls around attention.

Each rank of a sequence-parallel (SP) group of N ranks holds a contiguous 1/N of every sequence.
Everything but attention is per token, so it runs on the local slice unchanged. Attention needs
the whole sequence: before it, one all-to-all trades sequence for heads (each rank then holds
the full sequence for H/N query heads and K/N key/value heads); after it, the inverse all-to-all
trades them back. Both use `all_to_all_single` on dimension 0 (gloo has it; list-form
`all_to_all` it has not), and each is the other's gradient, so autograd sends every gradient
back to the rank that produced the activation.

GQA: rank j takes query heads [jH/N, (j+1)H/N) and kv heads [jK/N, (j+1)K/N); query head h
reads kv head h // (H/K) in both the full and the split layout, so SDPA's grouping is unchanged
(H and K must both divide by N: train/launch/sequence_parallel.py checks it up front).

Nothing here touches parameters or the checkpoint layout: a model with SP attached holds exactly
the weights of the same model without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SeqParallel:
    """This rank's place in its SP group: `group` (a torch process group of `size` ranks) and
    `rank` within it (which contiguous slice of each sequence this rank holds)."""
    group: Any
    size: int
    rank: int


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dimension 0 (size N chunks): chunk i goes to rank i of the group.
    The exchange is its own adjoint: the gradient takes the same route back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """(B, T/N, h, Hd) local slice, all heads -> (B, T, h/N, Hd) full sequence, this rank's heads."""
    B, t, h, d = x.shape
    n = sp.size
    x = x.reshape(B, t, n, h // n, d).permute(2, 0, 1, 3, 4)          # (N, B, T/N, h/N, Hd): chunk i -> rank i
    y = _AllToAll.apply(x, sp.group)                                  # chunk i <- rank i's slice i
    return y.permute(1, 0, 2, 3, 4).reshape(B, n * t, h // n, d)      # slices in sequence order


def heads_to_seq(y: torch.Tensor, sp: SeqParallel) -> torch.Tensor:
    """(B, T, h/N, Hd) full sequence, this rank's heads -> (B, T/N, h, Hd) local slice, all heads."""
    B, T, hl, d = y.shape
    n = sp.size
    y = y.reshape(B, n, T // n, hl, d).permute(1, 0, 2, 3, 4)         # (N, B, T/N, h/N, Hd): slice i -> rank i
    x = _AllToAll.apply(y, sp.group)                                  # chunk i <- rank i's heads
    return x.permute(1, 2, 0, 3, 4).reshape(B, T // n, n * hl, d)     # heads in order


def attach(model: torch.nn.Module, sp: SeqParallel | None) -> int:
    """Give every module that supports SP (the GPT and its attention layers: a `seq_parallel`
    attribute) this rank's group; a transformers model gets the "zerotrain_ulysses" attention
    (hf_attention) instead of its sdpa. None detaches. Returns the number of modules attached."""
    n = 0
    for m in model.modules():
        if hasattr(m, "seq_parallel"):
            m.seq_parallel = sp
            n += 1
    if n == 0 and hasattr(getattr(model, "config", None), "_attn_implementation"):
        n = _attach_hf(model, sp)
    return n


# ----------------------------------------------------------------------------- transformers models

HF_NAME = "zerotrain_ulysses"
_HF = {"sp": None}  # the process's SP group for the registered attention function (one group per rank)


def hf_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention-function interface (query (B, H, T/N, Hd) after RoPE, key/value
    (B, K, T/N, Hd)) around its own sdpa: the all-to-all, sdpa over the whole sequence for H/N and
    K/N heads (module.num_key_value_groups, H/K, is unchanged), the inverse all-to-all.
    The model's mask was made for the local slice: unused. The whole row is attended as
    transformers masks the layer: causal (sdpa's is_causal, no mask), and on a sliding-window
    layer (`layer_window`) banded, kv > q - window (masking_utils.sliding_window_causal_mask_function),
    by `windowed_sdpa`: query blocks against the keys their window reaches, so neither the mask nor
    the scores are T x T. Packed rows are refused with SP for hf: models
    (train/launch/sequence_parallel.py)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    sp = _HF["sp"]
    window = kwargs.pop("sliding_window", None) or layer_window(getattr(module, "config", None),
                                                                getattr(module, "layer_idx", None))
    q, k, v = (seq_to_heads(t.transpose(1, 2), sp).transpose(1, 2) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    if window is None:
        out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)   # (B, T, H/N, Hd)
    else:
        out = windowed_sdpa(lambda qb, kb, vb, m: sdpa_attention_forward(module, qb, kb, vb, m, is_causal=False,
                                                                          **kwargs)[0], q, k, v, window)
    return heads_to_seq(out, sp), None                                                       # (B, T/N, H, Hd)


# Layer types the SP attention reproduces (config.layer_types): any other is refused up front.
LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_window(config, layer_idx) -> int | None:
    """The sliding window of layer `layer_idx` as transformers' models choose its mask: with
    config.layer_types, config.sliding_window on a "sliding_attention" layer and none on a
    "full_attention" one (Qwen2/3, Gemma 2/3, Qwen2-MoE); without, config.sliding_window on every
    layer (Mistral, PhiMoE). None: plain causal attention."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    types = getattr(config, "layer_types", None)
    if types and layer_idx is not None:
        return window if types[layer_idx] == "sliding_attention" else None
    return window


def banded_causal_mask(q0: int, q1: int, k0: int, k1: int, window: int, device) -> torch.Tensor:
    """(1, 1, q1 - q0, k1 - k0) bool, True where query q in [q0, q1) may attend key kv in [k0, k1):
    kv <= q and kv > q - window."""
    q = torch.arange(q0, q1, device=device)[:, None]
    kv = torch.arange(k0, k1, device=device)[None, :]
    return ((kv <= q) & (kv > q - window))[None, None]


def windowed_sdpa(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                  block: int | None = None) -> torch.Tensor:
    """Sliding-window causal attention in query blocks: `attend(q_blk, k_blk, v_blk, mask)` (an
    sdpa over (B, H, t, Hd) queries and (B, K, s, Hd) keys/values returning (B, t, H, Hd)) is called
    for each block of `block` queries (default max(window, 128)) with only the keys their window
    reaches, [start - window + 1, end), and that block's banded mask. Each query sees exactly the
    keys of the dense T x T banded mask, so the result is the same attention (to rounding); the
    mask and the scores are block x (block + window) per call instead of T x T, so memory grows
    as T x window, not T^2 (BENCHMARKS.md "Sequence parallelism with a sliding window").
    Returns (B, T, H, Hd)."""
    T = q.size(2)
    step = block or max(window, 128)
    outs = []
    for s in range(0, T, step):
        e = min(T, s + step)
        k0 = max(0, s - window + 1)
        mask = banded_causal_mask(s, e, k0, e, window, q.device)
        outs.append(attend(q[:, :, s:e], k[:, :, k0:e], v[:, :, k0:e], mask))
    return torch.cat(outs, dim=1)


def _attach_hf(model, sp: SeqParallel | None) -> int:
    from transformers import AttentionInterface
    cfg = model.config
    if sp is None:
        cfg._attn_implementation = getattr(model, "_zerotrain_core_attention", cfg._attn_implementation)
        return 1
    if cfg._attn_implementation != HF_NAME:
        from zerotrain.models.errors import ConfigError
        if cfg._attn_implementation not in (None, "sdpa"):
            raise ConfigError(f'distributed.sequence_parallel: the model uses attn_implementation '
                              f'"{cfg._attn_implementation}", which the Ulysses all-to-all cannot wrap; set '
                              f"model.attn_implementation sdpa")
        windowed = [i for i in range(getattr(cfg, "num_hidden_layers", 0) or 0) if layer_window(cfg, i)]
        if windowed and "sliding_window" not in _modeling_source(model):
            raise ConfigError(f"distributed.sequence_parallel: config.json sets sliding_window but "
                              f"{type(model).__name__}'s code never reads it, so the window the SP attention "
                              f"would apply is not the model's; set distributed.sequence_parallel 1")
        model._zerotrain_core_attention = cfg._attn_implementation
    AttentionInterface.register(HF_NAME, hf_attention)
    _HF["sp"] = sp
    cfg._attn_implementation = HF_NAME
    return 1


def _modeling_source(model) -> str:
    import inspect
    try:
        return inspect.getsource(inspect.getmodule(type(model)))
    except (OSError, TypeError):
        return ""


__all__ = ["HF_NAME", "LAYER_TYPES", "SeqParallel", "attach", "banded_causal_mask", "heads_to_seq", "hf_attention",
           "layer_window", "seq_to_heads", "windowed_sdpa"]
