"""Ulysses sequence parallelism, the run side (distributed.sequence_parallel).

zerotrain's own all-to-all around attention (models/ulysses.py), not Accelerate's
`ParallelismConfig(sp_backend="deepspeed")` nor DeepSpeed's UlyssesSPDataLoaderAdapter, because
(docs/long_context.md): Accelerate's path needs an HF model (`model.config`), hands DeepSpeed an
mpu that averages gradients over world/N ranks, and its data adapter gives each SP rank a
*different* sample and then has all N ranks step through all N of them, which changes the data
order, the number of micro-batches per step and what a checkpoint's data position means.

Here DeepSpeed never hears of SP: it sees W ranks with micro samples each and ZeRO partitions and
averages over all W of them. What makes that exact:

* data: the sampler is the run's own, made for world/N data-parallel ranks (the order of a run
  without SP); `ReplicatedBatches` repeats each data-parallel rank's micro-batch N times, so that
  Accelerate's split (rank r gets the r-th slice) gives the N consecutive ranks of a group the
  same samples; each rank then keeps its contiguous 1/N of the sequence (`slice_batch`). Labels
  are shifted by the datasets themselves (labels[t] = token t+1), so slicing loses no target.
* loss: every rank's summed token loss is divided by (the step's labelled tokens over all ranks)
  / (accum x W) (the trainer's token denominator, on under SP whatever the data): the engines'
  mean over ranks and micro-batches then makes the gradient that of sum / count over the whole
  global batch, and the logged loss that same mean: exactly the loss without SP.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from zerotrain.train.config import Batch, RunConfig
from zerotrain.train.errors import ConfigError

WHOLE_KEYS = ("position_ids", "doc_ids")  # the GPT's attention reads them for the whole row
ATTENTION = ("sdpa",)                     # hf: attention implementations the all-to-all wraps


def size(cfg: RunConfig, world: int) -> int:
    """N, checked against the world size: N consecutive ranks make a group."""
    n = cfg.distributed.sequence_parallel
    if world % n:
        raise ConfigError(f"distributed.sequence_parallel {n} does not divide the world size {world}; "
                          f"launch a multiple of {n} processes or choose a divisor of {world}")
    return n


def engine_batch(batch: Batch, n: int) -> Batch:
    """What DeepSpeed sees: every one of the world's ranks with its micro-batch (the SP ranks of a
    group hold slices of the same samples), so train_batch_size = micro x accum x world."""
    return Batch(micro=batch.micro, accum=batch.accum, world=batch.world * n)


def refuse_unsupported(cfg: RunConfig, spec, seq_len: int | None, strategy) -> None:
    """Every combination SP cannot run, refused before anything is built (one line each). `strategy`
    refuses a backend that cannot split sequences (train/strategy/: plain DDP)."""
    n = cfg.distributed.sequence_parallel
    if n == 1:
        return
    flag = f"distributed.sequence_parallel {n}"
    if spec.family not in ("gpt", "hf"):
        raise ConfigError(f"{flag}: sequence parallelism splits a language model's sequence; model.name "
                          f'"{spec.name}" is a {spec.family} model: set distributed.sequence_parallel 1')
    strategy.check_sequence_parallel(flag)
    if seq_len is None or seq_len % n:
        raise ConfigError(f"{flag} does not divide data.seq_len {seq_len}: each rank holds seq_len / {n} tokens; "
                          f"choose a data.seq_len that is a multiple of {n}")
    packed = "data.packing" if cfg.data.packing else "data.document_mask" if cfg.data.document_mask else None
    if spec.family == "hf" and packed:  # the hf: attention under SP is causal over the whole row, no mask
        raise ConfigError(f"{flag} with {packed} on an hf: model is not supported (its document mask is made "
                          f"per slice); set {packed} false, or use the built-in GPT")
    heads, kv_heads = _heads(cfg, spec)
    for what, h in (("attention heads", heads), ("key/value heads", kv_heads)):
        if h % n:
            raise ConfigError(f"{flag} does not divide the model's {h} {what} ({spec.name}): each rank of a group "
                              f"attends with 1/{n} of them; choose a divisor of {h}")
    if cfg.hardware.compile:
        raise ConfigError(f"{flag} with hardware.compile true is not supported (the all-to-all is not traced); "
                          f"set hardware.compile false")


def _heads(cfg: RunConfig, spec) -> tuple[int, int]:
    if spec.family == "gpt":
        from zerotrain.models import gpt_config
        g = gpt_config(cfg.model, vocab_size=None)
        return g.n_head, g.n_kv_head
    hf = spec.hf_config or {}
    impl = hf.get("attn_implementation") or "sdpa"  # model.attn_implementation, else config.json's (models/hf.py)
    if impl not in ATTENTION:
        raise ConfigError(f'distributed.sequence_parallel: {spec.name} uses attn_implementation "{impl}", '
                          f"which the Ulysses all-to-all cannot wrap; set model.attn_implementation "
                          f"{' or '.join(ATTENTION)}")
    from zerotrain.models.ulysses import LAYER_TYPES
    other = sorted({t for t in hf.get("layer_types") or [] if t not in LAYER_TYPES})
    if other or hf.get("attention_chunk_size"):
        what = f"layer types {', '.join(other)}" if other else "chunked attention (attention_chunk_size)"
        raise ConfigError(f"distributed.sequence_parallel: {spec.name} has {what}, which the SP attention does not "
                          f"reproduce (it covers full and sliding-window causal layers); set "
                          f"distributed.sequence_parallel 1")
    heads = hf.get("num_attention_heads")
    return heads, hf.get("num_key_value_heads") or heads


@dataclass(frozen=True)
class SPRun:
    """This rank's SP group, made once the process group exists (`join`)."""
    size: int
    rank: int        # this rank's place in its group: which slice of each row it holds
    group: object    # torch process group of the N consecutive ranks
    ranks: tuple = ()  # the group's global ranks
    whole: tuple = WHOLE_KEYS  # batch keys the model reads whole (the GPT); hf: none, positions sliced

    @classmethod
    def join(cls, n: int, rank: int, world: int, family: str = "gpt") -> "SPRun":
        dist = torch.distributed
        groups = [dist.new_group(list(range(first, first + n))) for first in range(0, world, n)]  # every rank, in order
        first = rank - rank % n
        return cls(size=n, rank=rank % n, group=groups[rank // n], ranks=tuple(range(first, first + n)),
                   whole=WHOLE_KEYS if family == "gpt" else ())

    def record(self) -> dict:
        return {"size": self.size, "rank": self.rank, "ranks": list(self.ranks)}

    def model_side(self):
        from zerotrain.models.ulysses import SeqParallel
        return SeqParallel(group=self.group, size=self.size, rank=self.rank)

    def attach(self, model) -> None:
        from zerotrain.models.ulysses import attach
        if attach(model, self.model_side()) == 0:
            raise ConfigError(f"distributed.sequence_parallel {self.size}: {type(model).__name__} has no "
                              f"sequence-parallel attention; set distributed.sequence_parallel 1")

    @contextlib.contextmanager
    def detached(self, model):
        """Evaluation and sampling see whole rows on every rank: SP off inside, back on after."""
        from zerotrain.models.ulysses import attach
        attach(model, None)
        try:
            yield
        finally:
            attach(model, self.model_side())

    def slice_batch(self, batch: dict) -> dict:
        """This rank's contiguous 1/N of every (B, T) tensor; `whole` keys stay whole. A model that
        applies RoPE to the slice (hf:) gets the slice's own positions (position_ids made if absent)."""
        if not self.whole and "position_ids" not in batch:
            ids = batch["input_ids"]
            batch = {**batch, "position_ids": torch.arange(ids.size(1), device=ids.device).expand(ids.size(0), -1)}
        out = {}
        for k, v in batch.items():
            if k in self.whole or not torch.is_tensor(v) or v.dim() < 2:
                out[k] = v
            else:
                t = v.size(1) // self.size
                out[k] = v[:, self.rank * t:(self.rank + 1) * t]
        return out


class ReplicatedBatches:
    """A batch sampler made for world/N data-parallel ranks, each data-parallel rank's micro-batch
    repeated N times: Accelerate's split (split_batches, rank r takes the r-th of W slices) then
    gives the N ranks of a group the same samples. Everything else (position, epoch order, steps)
    is the wrapped sampler's."""

    def __init__(self, inner, n: int, micro: int):
        self.inner, self.n, self.micro = inner, n, micro
        self.batch_size = inner.batch_size * n  # read by Accelerate's BatchSamplerShard
        self.drop_last = inner.drop_last

    def __iter__(self):
        for idx in self.inner:
            out = []
            for first in range(0, len(idx), self.micro):
                out.extend(idx[first:first + self.micro] * self.n)
            yield out

    def __len__(self) -> int:
        return len(self.inner)
