"""Where a run stands in its data, and its batches from there.

The position itself lives in the TrainState (epoch, offset into the epoch's global order,
samples and tokens seen, tokens per mixture source, the stream's cursor), which checkpoints
save; DataPosition moves it by one global batch per optimizer step and starts the loader's
iterator where it says. All of it is host arithmetic, the same on every rank: no device read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from zerotrain.train.checkpoint.state import TrainState
    from zerotrain.train.data.bundle import DataBundle


class DataPosition:
    def __init__(self, data: DataBundle, sampler, loader: DataLoader, global_size: int):
        """`sampler`: the loader's resumable global batch sampler (GlobalBatchSampler,
        MixtureSampler or StreamSampler); `global_size`: samples per optimizer step."""
        self.data, self.sampler, self.loader, self.global_size = data, sampler, loader, global_size
        self._it = None               # the batch iterator; None: re-made at the state's position
        self._order = (None, None)    # (epoch, sampler.slicer) for counting real tokens

    def next_batch(self, state: TrainState) -> dict:
        """The next micro-batch of this rank, as the loader yields it."""
        if self._it is None:
            self.sampler.set_position(state.epoch, state.offset)
            self._it = iter(self.loader)
        b = next(self._it, None)
        if b is None:  # cannot happen mid-step: an epoch is a whole number of steps
            raise RuntimeError("data loader ran out inside an optimizer step")
        return b

    def advance(self, state: TrainState) -> tuple[TrainState, Optional[int]]:
        """Where one optimizer step's global batch leaves the data: `state` moved by it (a new
        TrainState: an epoch's end starts the next epoch; the trainer keeps it), and that
        batch's non-pad tokens where the data counts them, else None."""
        real = self._real_tokens(state)
        g, data = self.global_size, self.data
        per = dict(state.source_tokens)
        if data.mixture is not None:
            # The step's samples per source, from the plan (host arithmetic, the same on every rank).
            counts = self.sampler.step_counts(state.epoch, state.offset)
            for name, n in zip(data.mixture.names, counts.tolist()):
                per[name] = per.get(name, 0) + n * data.items_per_sample
        epoch, offset = state.epoch, state.offset + g
        # Where a resume restarts reading a stream (a dict lookup, once per step).
        cursor = data.stream.cursor_at(offset) if data.stream is not None else state.data_cursor
        if offset >= self.sampler.steps_per_epoch * g:
            epoch, offset = epoch + 1, 0
            self._it = None
        moved = replace(state, epoch=epoch, offset=offset, source_tokens=per, data_cursor=cursor,
                        samples_seen=state.samples_seen + g, tokens_seen=state.tokens_seen + g * data.items_per_sample)
        return moved, real

    def _real_tokens(self, state: TrainState) -> Optional[int]:
        """Non-pad tokens of this step's global batch (sft records or packed rows: their
        real_tokens), from the step's sample indices."""
        count = getattr(self.data.train, "real_tokens", None)
        if count is None:
            return None
        if self._order[0] != state.epoch:
            self._order = (state.epoch, self.sampler.slicer(state.epoch))
        return count(self._order[1](state.offset, state.offset + self.global_size))
