"""A small causal LM of the user's own (model.loss lm: forward(input_ids) returns (B, T, V)
logits): the py: lifecycle tests (resume onto another world size, model.init_from, zerotrain
import) train it."""

import torch
import torch.nn as nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids):
        h = self.emb(input_ids)                                           # (B, T, d)
        steps = torch.arange(1, h.size(1) + 1, device=h.device, dtype=h.dtype)[None, :, None]
        return self.head(h + torch.tanh(self.mix(h.cumsum(1) / steps)))  # causal: a running mean of the past


def build(vocab: int = 256, d: int = 32) -> nn.Module:
    return TinyLM(vocab, d)
