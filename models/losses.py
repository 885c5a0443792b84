"""Memory-lean cross-entropy for language models.

`F.cross_entropy(logits.float(), targets)` on a language model's (N, V) logits makes a
full fp32 copy of the logits and saves a second full fp32 tensor (the log-softmax) for
backward: for GPT-2 (V = 50304) and 16 x 1024 tokens that is 3.3 GB + 3.3 GB next to the
1.6 GB of bf16 logits. `cross_entropy` here computes the same fp32 mathematics chunk by
chunk over the rows:

* forward: per row, the max and log-sum-exp in fp32 on at most `chunk_bytes` of fp32
  temporaries at a time; the loss is the fp32 mean of (logsumexp - target logit).
* saved for backward: the input logits themselves (no copy), two fp32 (N,) vectors (row
  max and log of the sum of exponentials), the targets and the row count; nothing (N, V).
* backward: grad = (softmax(logits) - onehot(target)) * grad_out / count, again chunk by
  chunk in fp32, rounded once to the logits' dtype and written into one preallocated
  gradient tensor.

Numerics: for fp32 logits the loss and gradients are those of F.cross_entropy (up to the
last bits: the softmax is exp((x - max) - log sum) exactly as log_softmax forms it); for
16-bit logits they are those of F.cross_entropy(logits.float(), targets) in fp32, the
gradient rounded once to the logits' dtype.

ignore_index (default -100, as F.cross_entropy): rows whose target is ignore_index add
nothing and the mean is over the other rows. Instruction data (data.kind sft) ignores its
prompt and padding tokens this way. If every row is ignored the loss is 0 with zero
gradients (F.cross_entropy gives nan: 0/0), so a fully masked micro-batch cannot poison a run.

denominator (optional fp32 scalar tensor): divide the summed loss by it instead of by this
batch's number of valid rows. The trainer passes (global count of valid rows of the optimizer
step) / (accumulation x world), so that after the engines' own averaging over micro-batches
and ranks the gradient is that of sum / global count (train/training/trainer.py).

Device-agnostic: only ordinary tensor ops, no host synchronisation in forward or backward.
Memory and time against F.cross_entropy: BENCHMARKS.md "LM loss: fp32 logits never materialised".
"""

from __future__ import annotations

import contextlib

import torch

CHUNK_BYTES = 64 * 2 ** 20  # bound on each fp32 (rows, V) temporary
IGNORE_INDEX = -100         # a label that adds no loss (F.cross_entropy's default)


def _rows_per_chunk(vocab: int, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // (4 * max(1, vocab)))


def _row_stats(logits: torch.Tensor, chunk_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row max, log sum exp(x - max)), both fp32 (N,): logsumexp = max + logsum. As
    torch.logsumexp, a non-finite row max is replaced by 0 (all -inf rows give -inf)."""
    n, v = logits.shape
    rows = _rows_per_chunk(v, chunk_bytes)
    row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
    logsum = torch.empty(n, dtype=torch.float32, device=logits.device)
    buf = torch.empty((min(rows, n), v), dtype=torch.float32, device=logits.device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        x, b = logits[s:e], buf[:e - s]
        m = torch.amax(x, dim=-1).float()
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        torch.sub(x, m[:, None], out=b)  # fp32 (x - max), the 16-bit x converted exactly
        b.exp_()
        torch.sum(b, dim=-1, out=logsum[s:e])
        row_max[s:e] = m
    logsum.log_()
    return row_max, logsum


def _target_logits(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """(fp32 target logit per row (0 for ignored rows), valid-row mask, safe targets)."""
    valid = targets != ignore_index
    safe = torch.where(valid, targets, torch.zeros_like(targets))
    return logits.gather(1, safe[:, None]).squeeze(1).float(), valid, safe


def token_losses(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                 chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Per-row cross-entropy, fp32 (N,), without gradient and without an fp32 (N, V) copy;
    0 for ignored rows (as F.cross_entropy(..., reduction="none"))."""
    _check(logits, targets)
    targets = targets.long()  # gather's index dtype (no copy when already int64)
    with torch.no_grad(), _no_autocast(logits):
        m, logsum = _row_stats(logits, chunk_bytes)
        tgt, valid, _ = _target_logits(logits, targets, ignore_index)
        per_row = (m - tgt) + logsum  # -(x_t - max - logsum), log_softmax's order
        return torch.where(valid, per_row, torch.zeros_like(per_row))


class ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, chunk_bytes: int, denominator=None):
        with _no_autocast(logits):
            m, logsum = _row_stats(logits, chunk_bytes)
            tgt, valid, safe = _target_logits(logits, targets, ignore_index)
            per_row = (m - tgt) + logsum
            per_row = torch.where(valid, per_row, torch.zeros_like(per_row))
            # All rows ignored: 0, not 0/0. A given denominator may be below 1 (few tokens spread
            # over many micro-batches): the caller keeps it positive.
            count = valid.sum().to(torch.float32).clamp(min=1.0) if denominator is None \
                else denominator.to(torch.float32)
            loss = per_row.sum() / count
        ctx.save_for_backward(logits, m, logsum, safe, valid, count)
        ctx.chunk_bytes = chunk_bytes
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, m, logsum, safe, valid, count = ctx.saved_tensors
        n = logits.shape[0]
        with _no_autocast(logits):
            # grad_out / count per valid row, 0 for ignored rows (and everywhere when count is 0)
            scale = grad_out.float() / count
            row_scale = torch.where(valid, scale.expand(n), torch.zeros((), dtype=torch.float32, device=m.device))
            grad = _scaled_softmax_minus_onehot(logits, m, logsum, safe, row_scale, ctx.chunk_bytes)
        return grad, None, None, None, None


def _scaled_softmax_minus_onehot(logits, m, logsum, safe, row_scale, chunk_bytes: int) -> torch.Tensor:
    """(softmax(logits) - onehot(safe)) * row_scale per row, in the logits' dtype, computed in fp32
    chunks of at most `chunk_bytes` (m, logsum: each row's max and log-sum-exp from the forward):
    the backward of both the cross-entropy and the per-row log-probs."""
    n, v = logits.shape
    grad = torch.empty_like(logits)
    rows = _rows_per_chunk(v, chunk_bytes)
    fp32 = logits.dtype == torch.float32
    buf = None if fp32 else torch.empty((min(rows, n), v), dtype=torch.float32, device=logits.device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        b = grad[s:e] if fp32 else buf[:e - s]  # fp32 logits: work in the gradient itself
        torch.sub(logits[s:e], m[s:e, None], out=b)
        b.sub_(logsum[s:e, None])   # log_softmax = (x - max) - logsum
        b.exp_()                    # softmax
        b.scatter_add_(1, safe[s:e, None], torch.full((e - s, 1), -1.0, dtype=torch.float32, device=b.device))
        b.mul_(row_scale[s:e, None])
        if not fp32:
            grad[s:e].copy_(b)      # one rounding to the logits' dtype
    return grad


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                  chunk_bytes: int = CHUNK_BYTES, denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored rows of (N, V) logits (fp32, bf16 or fp16) and
    int64 targets (N,), as an fp32 scalar, computed in fp32 without ever holding an fp32
    (N, V) tensor bigger than `chunk_bytes` (see the module docstring). With `denominator`
    the summed loss is divided by it instead of by the number of non-ignored rows."""
    _check(logits, targets)
    targets = targets.long()
    if not logits.requires_grad:
        per_row = token_losses(logits, targets, ignore_index, chunk_bytes)
        count = (targets != ignore_index).sum().to(torch.float32).clamp(min=1.0) if denominator is None \
            else denominator.to(torch.float32)
        return per_row.sum() / count
    return ChunkedCrossEntropy.apply(logits.contiguous(), targets, int(ignore_index), int(chunk_bytes), denominator)


class ChunkedTokenLosses(torch.autograd.Function):
    """Per-row cross-entropy (N,) with a gradient, chunked as ChunkedCrossEntropy: backward is
    (softmax - onehot) x the row's incoming gradient, never an fp32 (N, V) tensor beyond a chunk."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, chunk_bytes: int):
        with _no_autocast(logits):
            m, logsum = _row_stats(logits, chunk_bytes)
            tgt, valid, safe = _target_logits(logits, targets, ignore_index)
            per_row = (m - tgt) + logsum
            per_row = torch.where(valid, per_row, torch.zeros_like(per_row))
        ctx.save_for_backward(logits, m, logsum, safe, valid)
        ctx.chunk_bytes = chunk_bytes
        return per_row

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        logits, m, logsum, safe, valid = ctx.saved_tensors
        with _no_autocast(logits):
            row_scale = torch.where(valid, grad_rows.float(), torch.zeros((), dtype=torch.float32, device=m.device))
            grad = _scaled_softmax_minus_onehot(logits, m, logsum, safe, row_scale, ctx.chunk_bytes)
        return grad, None, None, None


def token_logps(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """log p(target) per row of (N, V) logits, fp32 (N,), 0 for ignored rows, differentiable when
    the logits require grad: the fp32 mathematics of log_softmax(logits.float()).gather(targets)
    without an fp32 (N, V) copy (preference tuning sums them per sequence: models/preference.py)."""
    _check(logits, targets)
    targets = targets.long()
    if not logits.requires_grad:
        return -token_losses(logits, targets, ignore_index, chunk_bytes)
    return -ChunkedTokenLosses.apply(logits.contiguous(), targets, int(ignore_index), int(chunk_bytes))


def _check(logits: torch.Tensor, targets: torch.Tensor):
    if logits.dim() != 2 or targets.dim() != 1 or targets.size(0) != logits.size(0):
        raise ValueError(f"cross_entropy wants (N, V) logits and (N,) targets, got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"cross_entropy wants floating-point logits, got {logits.dtype}")
    if targets.is_floating_point() or targets.is_complex():
        raise ValueError(f"cross_entropy wants integer class targets, got {targets.dtype}")


def _no_autocast(t: torch.Tensor):
    """Everything here is deliberately fp32 (or the logits' own dtype): autocast must not
    re-cast the chunk arithmetic."""
    dev = t.device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except (RuntimeError, TypeError):  # a device type autocast does not know
        on = False
    return torch.autocast(device_type=dev, enabled=False) if on else contextlib.nullcontext()


__all__ = ["CHUNK_BYTES", "IGNORE_INDEX", "ChunkedCrossEntropy", "ChunkedTokenLosses", "cross_entropy", "token_logps",
           "token_losses"]
