"""A modern GPT-style decoder-only language model.

Llama-flavoured GPT: RMSNorm pre-norm blocks, rotary position embeddings,
grouped-query attention, SwiGLU MLP, no biases, optionally tied embeddings.

Written so it can be built under DeepSpeed ZeRO-3 ``deepspeed.zero.Init``, which
partitions every module's parameters the moment that module's own ``__init__``
returns. Hence every weight is initialised inside its leaf module's
``reset_parameters`` (called from the leaf's constructor) and nothing is
initialised afterwards (no ``self.apply(init_fn)``).

Shape legend: B batch, T sequence, D d_model, H query heads, K kv heads,
Hd head dim, F ffn hidden, V vocab.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zerotrain.models.ulysses import heads_to_seq, seq_to_heads


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128  # max context; sizes the RoPE tables
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4  # < n_head => grouped-query attention
    d_model: int = 128
    ffn_hidden: Optional[int] = None  # None => ffn_dim rule below
    multiple_of: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    tie_embeddings: bool = True
    activation_checkpointing: bool = False
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "multiple_of"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0):
            raise ValueError(f"ffn_hidden must be None or a positive int, got {self.ffn_hidden!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model/n_head = {self.head_dim} must be even for RoPE (d_model, n_head)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ffn_dim(self) -> int:
        """SwiGLU hidden size. Default: floor(8*d_model/3) rounded up to a multiple of
        `multiple_of` -- 8/3 keeps the 3-matrix SwiGLU at the parameter count of a
        4x GELU MLP (Llama rule; the rounding keeps matmuls tile-friendly)."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-(8 * self.d_model // 3) // self.multiple_of) * self.multiple_of

    def num_params(self, non_embedding: bool = False) -> int:
        """Analytic parameter count; equals the built model's unique parameters
        (a tied lm_head counts once). non_embedding=True drops the vocabulary
        matrices (token embedding and, if untied, lm_head), as in Kaplan et al."""
        d, kv_dim = self.d_model, self.n_kv_head * self.head_dim
        attn = d * (d + 2 * kv_dim) + d * d  # qkv + out projection
        mlp = 3 * d * self.ffn_dim  # gate, up, down
        per_layer = attn + mlp + 2 * d  # + two RMSNorm gains
        n = self.n_layer * per_layer + d  # + final norm
        if not non_embedding:
            n += self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return n

    def flops_per_token(self, seq_len: Optional[int] = None) -> int:
        """Training (fwd+bwd) FLOPs per token, PaLM appendix B / nanoGPT convention:

            6 * N + 12 * L * D * T

        N = num_params(non_embedding=True) + V*D: every weight that takes part in a
        matmul, with the lm_head matmul counted once even when tied (the embedding
        lookup is free). 6 = 2 (multiply-add) * 3 (fwd + 2x bwd). The second term
        is QK^T and AV: 2 matmuls * 2 flops * D * T per layer, times 3 for fwd+bwd
        (full TxT, i.e. causal masking not discounted). T defaults to seq_len."""
        t = self.seq_len if seq_len is None else seq_len
        n = self.num_params(non_embedding=True) + self.vocab_size * self.d_model
        return 6 * n + 12 * self.n_layer * self.d_model * t

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {unknown}")
        return cls(**d)


PRESETS: dict[str, GPTConfig] = {
    # Unit tests.
    "gpt-tiny": GPTConfig(vocab_size=256, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64),
    # Byte-level default that trains on a laptop CPU in minutes.
    "gpt-small-cpu": GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, n_kv_head=2, d_model=128),
    # GPT-2/GPT-3 size ladder. 50304 = GPT-2's 50257 padded to a multiple of 64.
    "gpt2-124m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_kv_head=12, d_model=768),
    "gpt-350m": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, n_kv_head=16, d_model=1024),
    "gpt-760m": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, n_kv_head=16, d_model=1536),
    "gpt-1.3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, n_kv_head=8, d_model=2048),
    "gpt-3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=28, n_head=24, n_kv_head=8, d_model=3072),
    # Llama-7B shape: multiple_of=256 gives Llama's ffn 11008 and 6.74B params.
    "gpt-7b": GPTConfig(vocab_size=32000, seq_len=4096, n_layer=32, n_head=32, n_kv_head=32, d_model=4096,
                        multiple_of=256, tie_embeddings=False),
}


def preset(name: str, **overrides) -> GPTConfig:
    """A copy of PRESETS[name] with overrides applied (None values ignored, so CLI
    flags left unset pass straight through). Re-validates the result."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(GPTConfig)})
    if unknown:
        raise ValueError(f"unknown GPTConfig fields in overrides: {unknown}")
    return dataclasses.replace(PRESETS[name], **overrides)


# ----------------------------------------------------------------------------- leaf modules
# Each leaf draws its own weights in reset_parameters, which nn.Linear/nn.Embedding
# call from their constructors: under zero.Init this runs on the full tensor just
# before it is partitioned. `std` is set before super().__init__ for that reason.

class Linear(nn.Linear):
    def __init__(self, in_features: int, out_features: int, std: float):
        self.std = std
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self):
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class Embedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, std: float):
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self):
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.ones_(self.weight)

    def forward(self, x):  # (..., D) -> (..., D), same dtype as x
        # fp32 because the mean of squares under/overflows in bf16/fp16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


class Rotary(nn.Module):
    """cos/sin tables for RoPE, (T, Hd/2) in fp32, computed on first use per device and cached.

    Not buffers, and nothing is computed in __init__: tables built at construction take the
    dtype construction happens under. deepspeed.zero.Init with bf16 turns every floating
    tensor a constructor creates (torch.arange included) into bf16, which rounds angles above
    256 radians to even numbers or coarser, so late positions would rotate by the wrong angle.
    Derived purely from the config, they are never partitioned, cast, moved or checkpointed."""

    def __init__(self, head_dim: int, seq_len: int, theta: float):
        super().__init__()
        self.head_dim, self.seq_len, self.theta = head_dim, seq_len, theta
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, T: int, device: torch.device, positions: Optional[torch.Tensor] = None):
        """2 x (T, Hd/2) for positions 0..T-1, or 2 x (B, 1, T, Hd/2) for per-token `positions`
        (B, T): packed rows restart each document's positions at 0 (broadcast over heads)."""
        if device not in self._cache:
            self._cache[device] = self._tables(device)
        cos, sin = self._cache[device]
        if positions is None:
            return cos[:T], sin[:T]
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # (B, 1, T, Hd/2)

    def _tables(self, device):
        # Explicit fp32 on the target device; no ambient dtype or device can change it.
        inv_freq = self.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        angles = torch.outer(torch.arange(self.seq_len, dtype=torch.float64), inv_freq)  # (T, Hd/2)
        return (angles.cos().to(device=device, dtype=torch.float32),
                angles.sin().to(device=device, dtype=torch.float32))


def apply_rope(x, cos, sin):  # x (B, h, T, Hd); cos/sin (T, Hd/2) or (B, 1, T, Hd/2) -> (B, h, T, Hd)
    # Rotate-half (GPT-NeoX / HF Llama) layout: pairs are (i, i + Hd/2).
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)  # back to the matmul dtype so SDPA sees uniform dtypes


def document_mask(doc_ids: Optional[torch.Tensor], dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
    """Block-diagonal causal mask of packed rows: query i sees key j iff j <= i and both tokens
    belong to the same document. doc_ids (B, T) int -> (B, 1, T, T) additive mask in `dtype`
    (0 = attend, -inf = not), or None (plain causal attention). Every token sees itself, so no
    row is all-masked.

    Built once per batch in the dtype attention computes in and shared by every layer: SDPA takes
    it as it is and saves that one tensor for backward. A bool mask would be converted to a float
    copy inside each layer's SDPA call and saved by each (one (B, 1, T, T) tensor per layer;
    tests/test_plan.py counts the saved tensors)."""
    if doc_ids is None:
        return None
    T = doc_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril_()  # (T, T)
    keep = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal                # (B, T, T) bool
    bias = torch.zeros(keep.shape, dtype=dtype, device=doc_ids.device)
    return bias.masked_fill_(~keep, float("-inf")).unsqueeze(1)                 # (B, 1, T, T)


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype q, k and v have in the attention, from the embedding output x: the autocast dtype
    where autocast is on, else x's = the parameters' (DeepSpeed 16-bit: bf16/fp16 weights). Read
    from an activation, not a parameter: under ZeRO-3 touching a module's weight outside its own
    forward gathers it."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


# ----------------------------------------------------------------------------- blocks

class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.dropout = cfg.dropout
        kv_dim = cfg.n_kv_head * cfg.head_dim
        self.qkv = Linear(cfg.d_model, cfg.d_model + 2 * kv_dim, cfg.init_std)  # one matmul for q, k, v
        # GPT-2 scaled init: each block adds two residual branches, so shrink them
        # by sqrt(2L) to keep the residual stream's variance ~constant with depth.
        self.proj = Linear(cfg.d_model, cfg.d_model, cfg.init_std / math.sqrt(2 * cfg.n_layer))
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.seq_parallel = None  # models/ulysses.py SeqParallel: x is this rank's slice

    def forward(self, x, cos, sin, mask=None):  # x (B, T, D), mask None or (B, 1, T, T) additive -> (B, T, D)
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_head * self.head_dim, self.n_kv_head * self.head_dim,
                                     self.n_kv_head * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim)
        k = k.view(B, T, self.n_kv_head, self.head_dim)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        sp = self.seq_parallel
        if sp is not None:  # Ulysses: the whole sequence for H/N query and K/N kv heads (cos, sin, mask: whole)
            q, k, v = seq_to_heads(q, sp), seq_to_heads(k, sp), seq_to_heads(v, sp)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, Hd), 2 x (B, K, T, Hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_kv_head != self.n_head
        if gqa and q.is_cuda and q.dtype not in (torch.float16, torch.bfloat16):
            # On CUDA only the flash kernel (fp16/bf16) supports enable_gqa; anything
            # else silently falls back to the slow math kernel, so expand k/v instead.
            # Query head h reads kv head h // (H/K), matching enable_gqa's grouping.
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            gqa = False
        # Packed rows: the document mask (causal within each document); else plain causal.
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa,
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, Hd)
        y = y.transpose(1, 2)  # (B, T, H, Hd)
        if sp is not None:
            y = heads_to_seq(y, sp)  # back to this rank's slice, every head
        y = y.reshape(B, T, self.n_head * self.head_dim)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate_up = Linear(cfg.d_model, 2 * cfg.ffn_dim, cfg.init_std)  # fused gate & up: one matmul
        self.down = Linear(cfg.ffn_dim, cfg.d_model, cfg.init_std / math.sqrt(2 * cfg.n_layer))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, D) -> (B, T, D)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 x (B, T, F)
        return self.drop(self.down(F.silu(gate) * up))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask=None):  # (B, T, D) -> (B, T, D)
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------- model

class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = cfg = config
        self.tok_emb = Embedding(cfg.vocab_size, cfg.d_model, cfg.init_std)
        self.drop = nn.Dropout(cfg.dropout)
        self.rotary = Rotary(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, cfg.init_std)
        if cfg.tie_embeddings:
            # Same Parameter object: optimisers/ZeRO see it once, and counts dedupe it.
            self.lm_head.weight = self.tok_emb.weight
        self.seq_parallel = None  # models/ulysses.py: idx is this rank's slice of each sequence

    def forward(self, idx: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                doc_ids: Optional[torch.Tensor] = None) -> torch.Tensor:  # idx (B, T) int64 -> logits (B, T, V)
        """Packed rows (several documents per row) pass doc_ids (B, T), the document index of each
        token, and position_ids (B, T), each document's positions from 0: attention stays inside a
        document and RoPE sees the document's own positions, so every document is computed as if
        it had a row of its own. Without them: one causal sequence at positions 0..T-1.
        Under sequence parallelism (seq_parallel set) idx is this rank's contiguous slice of
        each row; position_ids and doc_ids, if given, are the whole rows' (attention sees them whole)."""
        B, T = idx.shape
        sp = self.seq_parallel
        T = T * sp.size if sp is not None else T  # the whole row's length
        if T > self.config.seq_len:
            raise ValueError(f"sequence length {T} exceeds config.seq_len {self.config.seq_len}")
        cos, sin = self.rotary(T, idx.device, position_ids)  # 2 x (T, Hd/2) or 2 x (B, 1, T, Hd/2), fp32
        x = self.drop(self.tok_emb(idx))  # (B, T, D)
        mask = document_mask(doc_ids, attention_dtype(x))  # None or (B, 1, T, T), every layer
        for block in self.blocks:
            if self.config.activation_checkpointing and self.training:
                # Recompute block activations in backward: memory O(L) -> O(1) blocks.
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        # Logits in the compute dtype; the trainer upcasts for the loss.
        return self.lm_head(self.norm(x))  # (B, T, V)

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters actually held; ds_numel sees through ZeRO-3 partitioning."""
        def count(ps):
            return sum(getattr(p, "ds_numel", p.numel()) for p in ps)
        n = count(self.parameters())  # parameters() dedupes the tied weight
        if non_embedding:
            n -= count({id(p): p for p in (self.tok_emb.weight, self.lm_head.weight)}.values())
        return n

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Sample max_new_tokens continuations of idx (B, T) -> (B, T + max_new_tokens).
        No KV cache: re-runs the (cropped) context each step. temperature <= 0 is greedy.
        Call model.eval() first if dropout > 0."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.seq_len:]  # RoPE tables only cover seq_len positions
            logits = self(ctx)[:, -1, :].float()  # (B, V)
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
