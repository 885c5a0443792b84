"""train.ema: an exponential moving average of the trained weights.

Each rank keeps the average of exactly the fp32 master elements it holds (Holder.held: the whole
parameter under DDP, its partition under ZeRO-1/2/3), on the device they live on, so the average
is sharded like the optimizer's moments and costs one fused lerp per update (no gather, no host
read). It is saved through the checkpoint like the moments (kind "ema": pieces per rank, in the
manifest with hashes), so a resume is bit-identical and may change the world size or the backend.

Evaluation (train.ema.evaluate) and the export (checkpoint.export_weights ema) swap the average
into the master weights, refresh the derived copies (low-precision weights, ZeRO-3's persistent
parameters: Holder.finish_load), and swap the live weights back, bit for bit."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from zerotrain.train.checkpoint.state import TrainState
    from zerotrain.train.config.schema import EmaConfig
    from zerotrain.train.strategy.holders import Holder, Slot
    from zerotrain.train.training.tick import Tick


class EMA:
    name = "ema"
    tensor_kinds = ("ema",)

    def __init__(self, cfg: EmaConfig, holder: Holder, evaluator, export: bool):
        self.cfg, self.holder, self.evaluator, self.export = cfg, holder, evaluator, export
        self.slots = [s for s in holder.slots if s.trainable and s.need[1] > s.need[0]]
        self.average: Optional[dict[str, torch.Tensor]] = None  # slot name -> its average over slot.need
        self.updates = 0
        self._pairs: Optional[tuple[list, list]] = None

    # ------------------------------------------------------------------ the loop
    def before_step(self, step: int) -> None:
        self._ready()

    def _ready(self) -> None:
        """The average and the (average, live) pairs the update walks, made once."""
        if self.average is None:  # a fresh run (or a checkpoint without one): the weights it starts from
            self.average = {s.name: self.holder.held(s).clone() for s in self.slots}
        if self._pairs is None:
            self._pairs = ([self.average[s.name] for s in self.slots], [self.holder.held(s) for s in self.slots])

    def on_step(self, tick: Tick) -> None:
        if tick.out is not None and tick.step % self.cfg.every_steps == 0:
            average, live = self._pairs
            torch._foreach_lerp_(average, live, 1.0 - self.cfg.decay)
            self.updates += 1
        if self.cfg.evaluate and any(k.startswith("val/") for k in tick.metrics):  # the live weights were evaluated
            with self.swapped():
                m = self.evaluator.run()
            tick.add_metrics({"val_ema/" + k[4:]: v for k, v in m.items() if k.startswith("val/")})

    @contextlib.contextmanager
    def swapped(self):
        """The average in place of the live weights (every rank: the refresh is collective under ZeRO)."""
        self._ready()
        average, live = self._pairs
        kept = [t.clone() for t in live]
        self.holder.begin_load()
        torch._foreach_copy_(live, average)
        self.holder.finish_load()
        try:
            yield
        finally:
            self.holder.begin_load()
            torch._foreach_copy_(live, kept)
            self.holder.finish_load()

    def exporting(self):
        """checkpoint.export_weights ema: the export writes the average."""
        return self.swapped() if self.export else contextlib.nullcontext()

    def banner(self) -> list[str]:
        c = self.cfg
        return [f"ema          decay {c.decay:g} every {c.every_steps} step(s), {self.updates} update(s) so far"
                + (", evaluated as val_ema/*" if c.evaluate else "") + (", exported" if self.export else "")]

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {"decay": self.cfg.decay, "every_steps": self.cfg.every_steps, "updates": self.updates}

    def load_state_dict(self, state: dict, at: TrainState) -> None:
        self.updates = int(state.get("updates", 0))

    def tensor(self, kind: str, slot: Slot) -> Optional[torch.Tensor]:
        """This rank's average of `slot` over slot.need (None: the slot has none)."""
        self._ready()
        return self.average.get(slot.name)

    def load_tensors(self, kind: str, read) -> None:
        """`read(slot)`: the checkpoint's values of slot.need, or None when it has no average
        (the run then averages from the weights it resumes with)."""
        values = {s.name: read(s) for s in self.slots}
        complete = all(v is not None for v in values.values())
        self.average = {s.name: values[s.name].to(self.holder.held(s).device) for s in self.slots} if complete else None
        self._pairs = None


def build(services) -> Optional[EMA]:
    cfg = services.cfg.train.ema
    if cfg is None:
        return None
    return EMA(cfg, services.holder, services.evaluator, export=services.cfg.checkpoint.export_weights == "ema")
