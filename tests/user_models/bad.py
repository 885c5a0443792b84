"""Factories that break the contract (tests/test_user_model.py: each a one-line refusal)."""


def not_a_module(**kwargs):
    return {"weights": [1.0, 2.0]}


def raises(d: int = 32):
    """A factory whose own argument check fails."""
    if d % 64:
        raise ValueError(f"d={d} must be a multiple of 64")
    raise AssertionError("unreachable in the tests")


def _lm(vocab: int, d: int):
    import torch.nn as nn
    return nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, vocab))


def meta_hostile(vocab: int = 256, d: int = 16):
    """A valid LM whose constructor reads a weight's value: it builds anywhere but on the meta device."""
    import torch
    model = _lm(vocab, d)
    with torch.no_grad():
        model[1].weight.mul_(1.0 / float(model[1].weight.abs().max()))  # .item() of a meta tensor raises
    return model


def flat_logits(vocab: int = 256, d: int = 16):
    """An LM whose forward returns (B, V), the last position's logits only: not model.loss lm's contract."""
    import torch.nn as nn

    class Last(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _lm(vocab, d)

        def forward(self, input_ids):
            return self.body(input_ids)[:, -1]
    return Last()
