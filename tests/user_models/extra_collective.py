"""A user's model with a rank-dependent collective (tests/test_collectives.py): at its
`at_step`-th training forward, rank 0 alone all-reduces a small tensor (a metric reduced under
`if rank == 0`, say), so the ranks part ways inside the step, where the engine's own collectives
(DDP's gradient all-reduce, DeepSpeed's on its process groups) are running."""

import torch
import torch.distributed as dist
import torch.nn as nn


class RankZeroReduces(nn.Module):
    def __init__(self, vocab: int, width: int, at_step: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.at_step, self.calls = at_step, 0

    def forward(self, input_ids):
        if self.training:
            self.calls += 1
            if self.calls == self.at_step and dist.is_initialized() and dist.get_rank() == 0:
                dist.all_reduce(torch.ones(5, 7))  # the bug: on rank 0 only
        return self.head(torch.tanh(self.mix(self.emb(input_ids))))


def build(vocab: int = 256, width: int = 64, at_step: int = 3) -> nn.Module:
    return RankZeroReduces(vocab, width, at_step)
