"""What a resumed run needs besides tensors: the position in training (saved as JSON in every
checkpoint; the trainer advances it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, Protocol


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
    mlflow_run_id: Optional[str] = None  # the MLflow run a resume continues (as W&B's run id)
    source_tokens: dict[str, int] = field(default_factory=dict)  # data.sources: tokens trained on per source name
    data_cursor: Optional[dict] = None  # data.kind stream: where to restart reading (train/data/stream.py)

    def to_dict(self) -> dict:
        return asdict(self)


class Stateful(Protocol):
    """A component with state to resume. The Checkpointer (train/checkpoint/manager.py) keeps
    `{name: obj.state_dict()}` of every registered component in meta.json's "state" and hands each
    its record back on resume, after the TrainState (`at`) is restored: a record from another
    backend, an older zerotrain or an import may lack what the component keeps, and `at` (the
    step and samples the run continues from) is what it then derives it from. Registering one
    (`Checkpointer.register(name, obj)`) is all a new component needs."""

    def state_dict(self) -> dict:
        """Plain JSON (numbers, strings, lists, dicts): meta.json is JSON, nothing is pickled."""
        ...

    def load_state_dict(self, state: dict, at: TrainState) -> None:
        """Restores from state_dict()'s record; `state` is {} when the checkpoint has none."""
        ...


class TensorState(Stateful, Protocol):
    """A Stateful that also keeps per-parameter tensors (train.ema's average): for each kind in
    `tensor_kinds`, the elements slot.need of a trained parameter that this rank holds (the
    strategy's holder, train/strategy/holders.py, says which). A save writes the slot.save part
    of each as pieces of that kind, like the moments: sharded per rank, in the manifest with
    hashes; a resume reads slot.need back under any world size and backend."""

    tensor_kinds: tuple[str, ...]

    def tensor(self, kind: str, slot) -> Optional[object]:
        """This rank's flat tensor over slot.need (uncopied), or None: the slot has none."""
        ...

    def load_tensors(self, kind: str, read) -> None:
        """`read(slot)`: the checkpoint's flat fp32 values over slot.need, or None where the
        checkpoint has no such tensor."""
        ...
