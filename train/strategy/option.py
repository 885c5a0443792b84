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
    backend: str                # "ddp" | "deepspeed"
    stage: Optional[int]
    precision: str              # "bf16" | "fp16" | "fp32"
    offload_optimizer: bool = False
    offload_param: bool = False
    zero: dict = field(default_factory=dict)
    bucket_view: bool = True    # DDP gradient_as_bucket_view
    bucket_cap_mb: float = DDP_BUCKET_CAP_MB
    grad_accum_fp32: bool = False  # 16-bit training accumulating gradients in fp32 (data_types)
    notes: tuple = ()

    def z(self, key):
        return float(self.zero.get(key, ZERO_DEFAULTS.get(key, 0)))

    @property
    def overlap_comm(self) -> bool:
        return bool(self.zero.get("overlap_comm", self.stage == 3))

    # ------------------------------------------------------------------ what the planner asks
    @property
    def splits_sequences(self) -> bool:
        """Can a run under this option use sequence parallelism? Plain DDP refuses it
        (DDPStrategy.check_sequence_parallel); every ZeRO stage splits sequences."""
        return self.backend != "ddp"

    @property
    def elem_bytes(self) -> int:
        """Bytes of a parameter, gradient or activation element in the training dtype."""
        return 4 if self.precision == "fp32" else 2

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_json(cls, label: str, path: Path, precision: Optional[str] = None,
                  width: Optional[int] = None) -> Option:
        """From a DeepSpeed JSON file, in its own precision or `precision`; `width` (the model's
        hidden size) fills the JSON's "auto" ZeRO sizes as a run would."""
        from zerotrain.train.strategy.ds_config import precision_of, read_ds_json
        ds = read_ds_json(path)
        prec = precision or precision_of(path, ds)
        if "ddp" in ds:
            return cls(label, str(path), "ddp", None, prec,
                       bucket_view=bool(ds["ddp"].get("gradient_as_bucket_view", False)),
                       bucket_cap_mb=float(ds["ddp"].get("bucket_cap_mb", DDP_BUCKET_CAP_MB)))
        zero = dict(ds.get("zero_optimization") or {"stage": 0})
        return _zero(label, str(path), prec, zero, ds.get("data_types"), width)

    @classmethod
    def from_setup(cls, ds) -> Option:
        """From train.strategy.ds_config.DSSetup (the trainer's resolved JSON: no "auto" left)."""
        if not ds.is_deepspeed:
            return cls(ds.describe(), ds.path, "ddp", None, ds.precision,
                       bucket_view=bool(ds.ddp_kwargs.get("gradient_as_bucket_view", False)),
                       bucket_cap_mb=float(ds.ddp_kwargs.get("bucket_cap_mb", DDP_BUCKET_CAP_MB)))
        return _zero(ds.describe(), ds.path, ds.precision, dict(ds.resolved.get("zero_optimization", {})),
                     ds.resolved.get("data_types"))

    @classmethod
    def default(cls, label: str, fname: str, precision: str) -> Option:
        """DeepSpeed's defaults for a shipped JSON's name (ddp.json, zero2_offload.json, ...) when
        ds_configs/ is not next to the package."""
        if fname == "ddp.json":
            return cls(label, None, "ddp", None, precision)
        stage = int(fname[4])
        zero = {"stage": stage}
        if "offload" in fname:
            zero["offload_optimizer"] = {"device": "cpu"}
            if stage == 3:
                zero["offload_param"] = {"device": "cpu"}
        return _zero(label, None, precision, zero)


def _zero(label, path, precision, zero, data_types=None, width=None) -> Option:
    from zerotrain.train.strategy.ds_config import ACCUM_DTYPES, AUTO_SIZES

    def on(block):
        return (zero.get(block) or {}).get("device") not in (None, "none")
    notes = []
    for k, v in list(zero.items()):
        if isinstance(v, str) and v.lower() == "auto":
            if width and k in AUTO_SIZES:
                zero[k] = AUTO_SIZES[k](width)   # what train/strategy/ds_config.py fills for this model
            else:
                zero.pop(k)                      # no width known: DeepSpeed's default stands in
                notes.append('"auto" ZeRO sizes need the model width: DeepSpeed\'s defaults shown '
                             '(5e8-element buckets; a run sizes them from its model)')
    stage = int(zero.get("stage", 0))
    accum = (data_types or {}).get("grad_accum_dtype")
    # train/strategy/ds_config.py fills fp32 accumulation for bf16 from stage 1 when the JSON is silent.
    fp32_accum = (ACCUM_DTYPES.get(str(accum).lower()) == "fp32") if accum else (precision == "bf16" and stage >= 1)
    return Option(label, path, "deepspeed", stage, precision, on("offload_optimizer"), on("offload_param"), zero,
                  grad_accum_fp32=fp32_accum and precision != "fp32", notes=tuple(dict.fromkeys(notes)))
