"""One training option as the planner prices it (Option): a DeepSpeed JSON (or the plain-DDP one)
reduced to what costs memory, read from a file, from the trainer's resolved DSSetup, or
DeepSpeed's defaults when no file is at hand. Its cost is train/strategy/cost.py; what the
planner may ask of it besides (`splits_sequences`, `elem_bytes`) is a property here, so that no
planner module asks which backend or stage an option is."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# DeepSpeed 0.19's zero_optimization defaults (deepspeed/runtime/zero/config.py).
ZERO_DEFAULTS = {"reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "contiguous_gradients": True,
                 "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
                 "stage3_max_live_parameters": 1e9, "sub_group_size": 1e9}
DDP_BUCKET_CAP_MB = 25        # torch DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Option:
    """One DeepSpeed JSON reduced to what costs memory."""

    label: str
    path: Optional[str]
    backend: str                # the registry's name: "ddp" | "deepspeed" | "fsdp2"
    stage: Optional[int]
    precision: str              # "bf16" | "fp16" | "fp32"
    offload_optimizer: bool = False
    offload_param: bool = False
    zero: dict = field(default_factory=dict)
    bucket_view: bool = True    # DDP gradient_as_bucket_view
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB
    grad_accum_fp32: bool = False  # 16-bit training accumulating gradients in fp32 (data_types)
    reshard_after_forward: bool = True  # FSDP2: a unit's gathered parameters freed after its forward
    notes: tuple = ()

    def z(self, key):
        return float(self.zero.get(key, ZERO_DEFAULTS.get(key, 0)))

    @property
    def overlap_comm(self) -> bool:
        return bool(self.zero.get("overlap_comm", self.stage == 3))

    # ------------------------------------------------------------------ what the planner asks
    @property
    def splits_sequences(self) -> bool:
        """Can a run under this option use sequence parallelism? Its backend says
        (train/strategy/registry.py; plain DDP refuses it: DDPStrategy.check_sequence_parallel)."""
        import zerotrain.train.strategy.registry as registry
        return registry.get(self.backend).splits_sequences

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
        """From train.strategy.ds_config.DSSetup (the trainer's resolved JSON: no "auto" left)."""
        import zerotrain.train.strategy.registry as registry
        return registry.get(ds.backend).option(ds.describe(), ds.path, ds.precision, ds.resolved, None)

    @classmethod
    def default(cls, label: str, fname: str, precision: str) -> Option:
        """The backend's defaults for a shipped file's name (ddp.json, zero2_offload.json, ...)
        when ds_configs/ is not next to the package."""
        import zerotrain.train.strategy.registry as registry
        return registry.for_option_file(fname).default_option(label, fname, precision)
