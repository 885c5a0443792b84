"""What a resumed run needs besides tensors: the position in training (saved as JSON in every
checkpoint; the trainer advances it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs (saved as JSON)."""

    step: int = 0            # optimizer steps completed
    epoch: int = 0
    offset: int = 0          # samples of `epoch` consumed (a multiple of the global batch)
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0   # non-finite or fp16-overflow steps not applied
    wandb_run_id: Optional[str] = None
    source_tokens: dict[str, int] = field(default_factory=dict)  # data.sources: tokens trained on per source name
    data_cursor: Optional[dict] = None  # data.kind stream: where to restart reading (train/data/stream.py)

    def to_dict(self) -> dict:
        return asdict(self)
