"""Would Ulysses sequence parallelism make a plan fit? The clause a refusal adds when one
sequence's activations are what does not fit: the memory check, --ds-config auto
(train/plan/memory_check.py) and `zerotrain plan` (train/commands/plan.py) all ask here.

Sequence parallelism changes the run's parallel layout (which ranks share a sample, how many
samples a rank holds per step), so nothing turns it on by itself, --ds-config auto included: a
plan that fits under no option names the smallest N that would make one fit, and the user
decides. Only sizes the run could use count: N larger than the current one, dividing the world
size and (checked by the caller) the heads, the key/value heads and the sequence length, under
a ZeRO option (plain DDP is refused with SP, so it is never the one that fits). When the model
states are what does not fit, no N helps and none is named; a model whose activations the planner
does not know (parameter count only, e.g. an hf: model) gets no suggestion either, as SP would
not change its plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from zerotrain.train.observe.report import human_bytes as hb


@dataclass(frozen=True)
class SPFit:
    """The smallest sequence-parallel size with an option that fits, and that option's plan."""

    n: int
    before: int        # activations per rank as the run stands
    estimate: object   # train.plan.estimate.Estimate of the option that fits with N

    def clause(self, flag: str, peak: str, how: str = "") -> str:
        """'--distributed.sequence_parallel 2 would fit (ZeRO-3: activations per rank 3.00 GiB -> 1.50 GiB, peak ...)'."""
        e = self.estimate
        return (f"{flag} {self.n}{how} would fit ({e.option.label}: activations per rank {hb(self.before)} -> "
                f"{hb(e.activations)}, peak {peak})")

    def record(self) -> dict:
        e = self.estimate
        return {"sequence_parallel": self.n, "option": e.option.label, "ds_config": e.option.path,
                "activations_bytes_before": self.before, "activations_bytes": e.activations,
                "peak_bytes": e.device_total}


def sizes(current: int, world: int, *divides: Optional[int]) -> list[int]:
    """Sequence-parallel sizes above `current`, ascending, that divide the world size and each of
    `divides` (heads, key/value heads, sequence length: None is not checked)."""
    return [n for n in range(current + 1, world + 1)
            if world % n == 0 and all(d is None or d % n == 0 for d in divides)]


def first_fit(before: Optional[int], candidates: Iterable[tuple[int, Iterable]],
              fits: Callable[[object], bool]) -> Optional[SPFit]:
    """The smallest N of `candidates` ((N, that plan's options in order of preference), N ascending;
    evaluated lazily) with a ZeRO option that `fits`. None when the activations are unknown
    (`before` None) or no N makes any option fit."""
    if before is None:
        return None
    for n, rows in candidates:
        e = next((r for r in rows if r.option.splits_sequences and fits(r)), None)
        if e is not None:
            return SPFit(n, before, e)
    return None
