"""One training option as the planner prices it (Option): a strategy file reduced to what costs
memory, read from a file, from the trainer's resolved DSSetup, or a backend's defaults when no
file is at hand; its backend reads what is its own (the registry entry's `option` and
`default_option`, its settings record). Its cost is train/strategy/cost.py; what the planner may
ask of it besides (`splits_sequences`, `elem_bytes`, `stage` for a plan's JSON) is a property
here, so that no planner module asks which backend or stage an option is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zerotrain.train.strategy.registry import Settings


@dataclass(frozen=True)
class Option:
    """One strategy file reduced to what costs memory: what every backend shares here, what its
    backend alone knows in `settings` (the backend's record: the one a run's DSSetup carries)."""

    #: the planner's name of the option, e.g. "ZeRO-2" (a run's own: its DSSetup.describe())
    label: str
    #: the strategy file; None: a shipped file's defaults without the file (Option.default)
    path: Optional[str]
    #: the registry's name: "ddp" | "deepspeed" | "fsdp2"
    backend: str
    #: the training precision: "bf16" | "fp16" | "fp32"
    precision: str
    #: the backend's own settings (registry.Settings: DDPSettings, ZeroSettings, FSDP2Settings),
    #: read by its cost (cost.py, the registry entry's `cost`)
    settings: Settings
    #: what the plan's table says of this reading (e.g. "auto" sizes priced at their defaults)
    notes: tuple = ()

    # ------------------------------------------------------------------ what the planner asks
    @property
    def splits_sequences(self) -> bool:
        """Can a run under this option use sequence parallelism? Its backend says
        (train/strategy/registry.py; plain DDP refuses it: DDPStrategy.check_sequence_parallel)."""
        import zerotrain.train.strategy.registry as registry
        return registry.get(self.backend).splits_sequences

    @property
    def stage(self) -> Optional[int]:
        """The ZeRO stage a plan's JSON reports ("stage"); None: a backend without stages."""
        return self.settings.zero_stage

    @property
    def elem_bytes(self) -> int:
        """Bytes of a parameter, gradient or activation element in the training dtype."""
        return 4 if self.precision == "fp32" else 2

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_json(cls, label: str, path: Path, precision: Optional[str] = None,
                  width: Optional[int] = None) -> Option:
        """From a strategy JSON file, in its own precision or `precision`; `width` (the model's
        hidden size) fills the JSON's "auto" sizes as a run would. The backend whose block the
        file holds reads it (train/strategy/registry.py)."""
        import zerotrain.train.strategy.registry as registry
        from zerotrain.train.strategy.ds_config import read_ds_json
        from zerotrain.train.strategy.precision import precision_of
        ds = read_ds_json(path)
        prec = precision or precision_of(path, ds)
        return registry.for_json(ds, path).option(label, str(path), prec, ds, width)

    @classmethod
    def from_setup(cls, ds) -> Option:
        """From train.strategy.ds_config.DSSetup (the trainer's resolved JSON: no "auto" left): its
        settings as its backend's parser read them."""
        return cls(ds.describe(), ds.path, ds.backend, ds.precision, ds.settings)

    @classmethod
    def default(cls, label: str, fname: str, precision: str) -> Option:
        """The backend's defaults for a shipped file's name (ddp.json, zero2_offload.json, ...)
        when ds_configs/ is not next to the package."""
        import zerotrain.train.strategy.registry as registry
        return registry.for_option_file(fname).default_option(label, fname, precision)
