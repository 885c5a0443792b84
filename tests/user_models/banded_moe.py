"""A user's own mixture-of-experts language model (tests/test_user_model.py): embedding, one
sparse block (an nn.ModuleList of experts and a router), a head. Nothing of zerotrain's.

The router may only choose among the experts of the token's band: ids below vocab / 2 go to
the first half of the experts, the others to the second half (top-k within the band, gates
learned). Each expert runs only on the tokens routed to it, so a rank whose tokens are all of
one band never runs (nor gives a gradient to) the other band's experts: the case where naive
ZeRO-3 (every module gathering its own parameters) would issue different collectives per rank."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class Expert(nn.Module):
    def __init__(self, d_model: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(d_model, ffn)
        self.down = nn.Linear(ffn, d_model)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class BandedSparseBlock(nn.Module):
    def __init__(self, d_model: int, ffn: int, n_experts: int, top_k: int):
        super().__init__()
        self.experts = nn.ModuleList(Expert(d_model, ffn) for _ in range(n_experts))
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.top_k = top_k

    def forward(self, h, high):  # h (N, D); high (N,) bool: the token's band
        n_exp = len(self.experts)
        half = torch.arange(n_exp, device=h.device) >= n_exp // 2          # (E,) experts of the high band
        logits = self.router(h).masked_fill(half[None, :] != high[:, None], float("-inf"))
        gates, chosen = logits.float().softmax(-1).topk(self.top_k, dim=-1)  # (N, k)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:  # no token for this expert here: it does not run
                continue
            out.index_add_(0, rows, expert(h[rows]) * gates[rows, slot, None].to(h.dtype))
        return out


class BandedMoELM(nn.Module):
    def __init__(self, vocab: int, d_model: int, ffn: int, n_experts: int, top_k: int):
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, d_model)
        self.mix = nn.Linear(2 * d_model, d_model)  # each position sees itself and the one before
        self.moe = BandedSparseBlock(d_model, ffn, n_experts, top_k)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, input_ids):  # (B, T) -> logits (B, T, V)
        x = self.emb(input_ids)
        prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
        h = x + self.mix(torch.cat([x, prev], -1))
        b, t, d = h.shape
        h = h + self.moe(h.reshape(b * t, d), (input_ids >= self.vocab // 2).reshape(-1)).view(b, t, d)
        return self.head(self.norm(h))


def build_model(vocab: int = 64, d_model: int = 32, ffn: int = 64, n_experts: int = 4, top_k: int = 2) -> nn.Module:
    return BandedMoELM(vocab, d_model, ffn, n_experts, top_k)
