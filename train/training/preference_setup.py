"""train.objective dpo at build time: the objective and its reference (models/preference.py), and
the precomputed reference log-probs attached to the data (train/data/reference.py).

The reference of sigmoid and ipo is precomputed (train.dpo.reference precomputed: read with the
data, no copy of the model), the model with its adapters off (model.lora), or a frozen copy of the
initial model; simpo needs none.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zerotrain.train.config import RunConfig
from zerotrain.train.errors import ConfigError, DataError

if TYPE_CHECKING:
    from zerotrain.models.spec import ModelSpec
    from zerotrain.models.workload import Workload
    from zerotrain.train.data.bundle import DataBundle
    from zerotrain.train.strategy import Strategy


def precomputed_reference(cfg: RunConfig) -> bool:
    """Does the run read its reference log-probs from files (train.dpo.reference precomputed; simpo has none)?"""
    return cfg.train.objective == "dpo" and cfg.train.dpo.reference == "precomputed" and cfg.train.dpo.loss != "simpo"


def reference_identity(cfg: RunConfig, spec: ModelSpec, seq_len: int, bundle: DataBundle, source: Path,
                       compute: str | None = None) -> dict:
    """What the precomputed reference log-probs of `source` depend on (train/data/reference.py):
    train.seed only where it fixes the starting weights (not an hf: model's); `compute`, how the
    strategy makes the model compute (Strategy.compute_form), once it is known (None: not checked
    here; a run checks it with check_reference_compute once its strategy exists)."""
    from zerotrain.train.data import reference
    return reference.identity(source, bundle.extra["tokenizer_sha256"], bundle.extra["chat_template"], seq_len,
                              cfg.model.name, cfg.train.seed if spec.family != "hf" else 0, compute)


def attach_reference(cfg: RunConfig, spec: ModelSpec, seq_len: int, bundle: DataBundle) -> None:
    """train.dpo.reference precomputed: every pair (training and validation) gets its reference
    log-probs from the file beside its JSONL file, checked against this run (one line if stale;
    the compute form later, check_reference_compute)."""
    from zerotrain.train.data import reference
    for pairs in (bundle.train, bundle.val):
        if pairs is not None:
            if pairs.source is None:
                raise DataError(f"train.dpo.reference precomputed: data.path {cfg.data.path} is not one JSONL file, and "
                                f"the reference file is keyed by a JSONL file's lines; write the records as one .jsonl "
                                f"file, or use train.dpo.reference live")
            want = reference_identity(cfg, spec, seq_len, bundle, pairs.source)
            pairs.attach_reference(*reference.load(pairs.source, want, pairs.lines))


def check_reference_compute(bundle: DataBundle, strategy: Strategy, device_type: str) -> None:
    """The attached reference files were computed as `strategy` makes the model compute on
    `device_type` (its precision and backend form, Strategy.compute_form): else their log-probs
    are not the step-1 policy's (in bf16 the rewards would not start at 0). One line naming the
    file, both forms and the prepare command with this run's strategy file (DataError, exit 2)."""
    from zerotrain.train.data import reference
    for pairs in (bundle.train, bundle.val):
        if pairs is not None and pairs.source is not None:
            reference.check_compute(pairs.source, strategy.compute_form(device_type), strategy.path)


def preference(cfg: RunConfig, workload: Workload, strategy: Strategy, device):
    """train.objective dpo's objective and its live reference (models/preference.py): under
    model.lora the model with its adapters off, else a frozen copy of the initial model."""
    from zerotrain.models.preference import Preference, frozen_copy
    d, lora = cfg.train.dpo, workload.lora is not None
    reference = None
    if d.loss != "simpo" and d.reference == "precomputed":  # read with the data (load_data): no copy
        return Preference(d.loss, d.beta, d.gamma, precomputed=True, ipo_sum=d.ipo_sum)
    if d.loss != "simpo" and not lora:
        strategy.check_frozen_copy(f"train.dpo.loss {d.loss}")
        if cfg.model.init_from:
            raise ConfigError("train.dpo: the reference of full fine-tuning is a copy of the model as built, before "
                              "model.init_from is loaded; export those weights as an hf: directory and name it in "
                              "model.name, or add model.lora")
        reference = strategy.place_frozen_copy(frozen_copy(workload.model), device)
    return Preference(d.loss, d.beta, d.gamma, reference=reference, lora=lora, ipo_sum=d.ipo_sum)
